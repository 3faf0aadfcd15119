"""Data pipeline: sources → chat tokens + assistant masks → array_record datasets → fixed-shape batches.

Re-exports only; see `sources`, `chat`, `tfds_builders` and `batching` for the implementations.
"""

from layerwave.data.batching import Batch
from layerwave.data.batching import BatchIterator
from layerwave.data.batching import epoch_order
from layerwave.data.batching import Position
from layerwave.data.chat import assistant_spans
from layerwave.data.chat import CHAT_FORMATS
from layerwave.data.chat import encode_chat
from layerwave.data.chat import encode_plain
from layerwave.data.chat import encode_prompt
from layerwave.data.chat import encode_record
from layerwave.data.chat import Encoded
from layerwave.data.chat import render_plain
from layerwave.data.chat import tokenize_text
from layerwave.data.sources import get_source
from layerwave.data.sources import read_gsm8k
from layerwave.data.sources import read_humaneval
from layerwave.data.sources import read_mtbench
from layerwave.data.sources import read_sharegpt
from layerwave.data.sources import read_text
from layerwave.data.sources import Record
from layerwave.data.sources import salvage_json_array
from layerwave.data.sources import SOURCES
from layerwave.data.sources import SourceError
from layerwave.data.tfds_builders import build_chat_dataset
from layerwave.data.tfds_builders import ChatDataset
from layerwave.data.tfds_builders import default_data_dir
from layerwave.data.tfds_builders import open_split
from layerwave.data.tfds_builders import split_of
from layerwave.data.tfds_builders import tokenizer_fingerprint
