"""Continuous batching: prompts stream through a fixed number of decoding rows ("slots").

Static batching (`layerwave.generate` without `slots`) decodes a batch until its longest row ends, so a row
that finished early, or that fell into a repetition loop, keeps paying for decode steps. Here, as in
JetStream's and MaxText's engines, B rows share one preallocated `KVCache [B, S]`:

* decode runs in jitted chunks of `chunk_steps` steps (`decode_steps`, a `fori_loop`, no host sync inside); a row
  stops at EOS or at `max_new_tokens`, and a stopped row does not advance;
* between chunks the host collects every finished row, asks the optional `stop_fn` about the live ones (a
  repetition loop, the start of a new turn: anything the caller would cut afterwards), and refills free rows
  with queued prompts: each is prefilled at a power-of-two width into a small cache and scattered into its row
  of the big one (`_insert`, the state donated, so the update is in place; `warmup` compiles every width);
* attention reads only the cache slots a live row can reach in this chunk: the chunk's read bound is the
  longest live context plus `chunk_steps`, rounded up to `READ_BUCKET` slots (one compilation per bucket),
  not the S slots preallocated for the longest prompt plus `max_new_tokens`.

Across processes (a mesh over several hosts) every process runs this same host loop over the same global
state: each holds the whole queue, and the finished flags, counts and tokens it decides from are gathered from
every device (`sharding.to_host`), so all processes refill, stop and return alike.

Results do not depend on the schedule. Greedy rows are those of `layerwave.generate` on each prompt alone (up
to float summation order, which tests check on real prompts). When sampling, the token at answer position j
of a request is drawn with `fold_in(fold_in(key(seed), request.seed_index), j)`: the same whichever row or
chunk the request lands in, and for any slot count (this stream differs from static `generate`'s, which
splits one key per step for the whole batch).

API: `Engine(target, slots, max_new_tokens, ...)`, then `submit(Request)` any time (also from inside the loop,
e.g. a conversation's next turn) and `step()` until `busy` is False; each `step` returns the requests that
finished. `generate_continuous` wraps it for a list of prompts (`layerwave.generate(..., slots=B)`).

Legend (`layerwave.axes`): B batch (the decoding rows), S cache slots (per row), T tokens (each row's new ones),
P prompt width.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from layerwave import sharding
from layerwave.inference import Target, cached_forward, check_token_ids, compute_dtype, logits_fn, new_cache
from layerwave.models.kv_cache import KVCache, causal_mask
from layerwave.sampling import SamplingParams, sample

READ_BUCKET = 64  # the attention read bound is a multiple of this many cache slots
PREFILL_MIN_WIDTH = 32  # prefill widths are powers of two from this, capped at S


@dataclasses.dataclass
class Request:
  """One prompt to answer.

  Attributes:
    ids: the prompt's token ids.
    seed_index: selects the request's random stream (`fold_in(key(seed), seed_index)`; any uint32).
    tag: the caller's handle, returned with the result.
  """

  ids: Sequence[int]
  seed_index: int = 0
  tag: Any = None


@dataclasses.dataclass
class Finished:
  """A finished request: its new tokens (cut after EOS, included) and why it ended."""

  request: Request
  tokens: list[int]
  reason: str  # "eos", "length" (max_new_tokens) or "stop" (stop_fn)


@struct.dataclass
class SlotState:
  """The decoding rows on device. `tokens [B, T]`: each row's new tokens, `count [B]` how many."""

  tokens: jax.Array
  count: jax.Array
  last: jax.Array  # [B] the newest token, not yet in the cache
  lengths: jax.Array  # [B] committed cache length (prompt + count - 1)
  done: jax.Array  # [B] the row does not advance
  seed_index: jax.Array  # [B] uint32, the row's request's random stream
  cache: KVCache


def _row_keys(base_key, seed_index, position):
  return jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(base_key, i), j))(seed_index, position)


def _sample_rows(logits, base_key, seed_index, position, sampling: SamplingParams):
  """One token per row; row r's key depends on its request and answer position only."""
  if sampling.greedy:
    return sample(logits, None, sampling)
  keys = _row_keys(base_key, seed_index, position)
  return jax.vmap(lambda l, k: sample(l, k, sampling))(logits, keys)


def _is_eos(tokens, eos_ids):
  if not eos_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "mesh", "slots", "cache_slots", "max_new_tokens",
                                             "dtype"))
def _init(*, config, mesh, slots, cache_slots, max_new_tokens, dtype) -> SlotState:
  z = lambda dt: jnp.zeros((slots,), dt)
  return SlotState(tokens=jnp.zeros((slots, max_new_tokens), jnp.int32), count=z(jnp.int32),
                   last=z(jnp.int32), lengths=z(jnp.int32), done=jnp.ones((slots,), bool),
                   seed_index=z(jnp.uint32), cache=new_cache(config, slots, cache_slots, dtype, mesh))


@functools.partial(jax.jit, donate_argnums=(2,), static_argnames=(
    "graphdef", "sampling", "eos_ids", "max_new_tokens"))
def _insert(graphdef, params, state: SlotState, rows, tokens, lengths, seed_index, base_key, *, sampling,
            eos_ids, max_new_tokens) -> SlotState:
  """Prefills `tokens [b, P]` (right-padded, `lengths [b]`) and puts them into `rows [b]` of `state`.

  Rows equal to B (padding) are dropped. The first new token is sampled here (answer position 0).
  """
  b, width = tokens.shape
  fresh = lambda big: jnp.zeros((b, width) + big.shape[2:], big.dtype)
  small = KVCache(tuple(map(fresh, state.cache.keys)), tuple(map(fresh, state.cache.values)))
  valid = (jnp.arange(width)[None, :] < lengths[:, None]).astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
  out = cached_forward(graphdef, params, tokens, positions, causal_mask(valid), small,
                       jnp.zeros((b,), jnp.int32), compute_logits=False, valid=valid)
  last_h = jnp.take_along_axis(out.last_hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  first = _sample_rows(logits_fn(graphdef, params)(last_h), base_key, seed_index, jnp.zeros((b,), jnp.int32),
                       sampling)
  put = lambda big, new: big.at[rows, :width].set(new.astype(big.dtype), mode="drop")
  cache = KVCache(tuple(map(put, state.cache.keys, out.cache.keys)),
                  tuple(map(put, state.cache.values, out.cache.values)))
  set_rows = lambda a, v: a.at[rows].set(v, mode="drop")
  new_rows = jnp.zeros((b, state.tokens.shape[1]), jnp.int32).at[:, 0].set(first)
  return SlotState(tokens=set_rows(state.tokens, new_rows), count=set_rows(state.count, jnp.ones((b,), jnp.int32)),
                   last=set_rows(state.last, first), lengths=set_rows(state.lengths, lengths),
                   done=set_rows(state.done, _is_eos(first, eos_ids) | (max_new_tokens <= 1)),
                   seed_index=set_rows(state.seed_index, seed_index), cache=cache)


@functools.partial(jax.jit, donate_argnums=(2,), static_argnames=(
    "graphdef", "sampling", "eos_ids", "steps", "read_slots"))
def decode_steps(graphdef, params, state: SlotState, base_key, *, sampling, eos_ids, steps,
                 read_slots) -> SlotState:
  """`steps` decode steps for every live row; attention reads the first `read_slots` cache slots."""
  s, max_new = state.tokens.shape
  rows = jnp.arange(s)

  def body(_, st: SlotState) -> SlotState:
    o = cached_forward(graphdef, params, st.last[:, None], st.lengths[:, None], jnp.ones((s, 1, 1), bool),
                       st.cache, st.lengths, read_slots=read_slots)
    nxt = _sample_rows(o.logits[:, 0], base_key, st.seed_index, st.count, sampling)
    live = ~st.done
    count = st.count + live
    return SlotState(
        tokens=st.tokens.at[rows, jnp.where(live, st.count, max_new)].set(nxt, mode="drop"),
        count=count, last=jnp.where(live, nxt, st.last), lengths=st.lengths + live,
        done=st.done | (live & (_is_eos(nxt, eos_ids) | (count >= max_new))),
        seed_index=st.seed_index, cache=o.cache)

  return jax.lax.fori_loop(0, steps, body, state)


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


class Engine:
  """Continuous-batching decoder over `slots` rows (the module docstring says how it works).

  Args:
    target: a loaded `Target`.
    slots: B, decoding rows (a multiple of the mesh's data axis).
    max_new_tokens: T, the most new tokens per request.
    max_prompt_tokens: the longest prompt the cache holds (S = it + T, rounded up to `READ_BUCKET`).
    temperature, top_k, top_p, seed: sampling (the module docstring says how the random streams are drawn).
    ignore_eos: rows run to `max_new_tokens` (benchmarks).
    stop_fn: `stop_fn(tokens) -> bool`, asked between chunks about each live row's tokens so far; True ends it
      (reason "stop"). Called on the host, once per live row per chunk.
    chunk_steps: decode steps per jitted chunk (between host refills).
    log_every: seconds between progress lines (0 = none).
  """

  def __init__(self, target: Target, slots: int, max_new_tokens: int, max_prompt_tokens: int, *,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               ignore_eos: bool = False, stop_fn: Callable[[list[int]], bool] | None = None,
               chunk_steps: int = 16, log_every: float = 0.0):
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}.")
    if int(slots) != slots or slots < 1:
      raise ValueError(f"slots must be a positive integer (decoding rows), got {slots}.")
    if chunk_steps < 1:
      raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}.")
    data = sharding.data_size(target.mesh)
    if slots % data:
      raise ValueError(f"slots={slots} is not a multiple of the mesh's data axis ({data} devices): every device "
                       f"holds the same number of rows; use slots={-(-slots // data) * data}.")
    config = target.config
    longest = int(max_prompt_tokens) + int(max_new_tokens)
    if longest > config.max_position_embeddings:
      raise ValueError(
          f"The longest prompt ({max_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {longest} "
          f"exceeds the model's max_position_embeddings ({config.max_position_embeddings}); shorten the "
          "prompts or lower max_new_tokens.")
    self.target, self.slots, self.max_new_tokens = target, int(slots), int(max_new_tokens)
    self.max_prompt_tokens = int(max_prompt_tokens)
    self.cache_slots = -(-longest // READ_BUCKET) * READ_BUCKET
    self.sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    self.eos_ids = () if ignore_eos else tuple(target.eos_token_ids)
    self.stop_fn, self.chunk_steps, self.log_every = stop_fn, int(chunk_steps), float(log_every)
    self.base_key = jax.random.key(seed)
    self.state = _init(config=config, mesh=target.mesh, slots=self.slots, cache_slots=self.cache_slots,
                       max_new_tokens=self.max_new_tokens, dtype=compute_dtype(target.graphdef, target.params))
    self.queue: collections.deque[Request] = collections.deque()
    self.rows: list[Request | None] = [None] * self.slots
    self.prompt_len = np.zeros(self.slots, np.int64)
    self.stats = {"finished": 0, "tokens": 0, "row_steps": 0, "chunks": 0, "prefills": 0, "seconds": 0.0,
                  "stopped": 0}
    self._last_log = time.perf_counter()

  # -- queue ---------------------------------------------------------------------------------------

  def submit(self, request: Request, front: bool = False) -> None:
    """Queues a request (`front`: before the others, e.g. a conversation's next turn)."""
    ids = [int(t) for t in request.ids]
    if not ids:
      raise ValueError("A prompt is empty: every prompt needs at least one token.")
    if len(ids) > self.max_prompt_tokens:
      raise ValueError(f"A prompt of {len(ids)} tokens is longer than the engine's cache allows "
                       f"(max_prompt_tokens={self.max_prompt_tokens}); raise max_prompt_tokens or shorten it.")
    check_token_ids(np.asarray(ids), self.target.config.vocab_size)
    request.ids = ids
    (self.queue.appendleft if front else self.queue.append)(request)

  @property
  def busy(self) -> bool:
    return bool(self.queue) or any(r is not None for r in self.rows)

  # -- the loop ------------------------------------------------------------------------------------

  def refill(self) -> None:
    """Prefills queued prompts into the free rows (one prefill per prompt); `step` calls it first."""
    free = [r for r in range(self.slots) if self.rows[r] is None]
    if not free or not self.queue:
      return
    take = []
    while free[len(take):] and self.queue:
      take.append((free[len(take)], self.queue.popleft()))
    t = self.target
    for row, req in take:  # one prompt per prefill: a few widths compile, whatever the number of free rows
      width = self._prefill_width(len(req.ids))
      tokens = np.zeros((1, width), np.int32)
      tokens[0, :len(req.ids)] = req.ids
      self.rows[row], self.prompt_len[row] = req, len(req.ids)
      self.state = _insert(t.graphdef, t.params, self.state, np.asarray([row], np.int32), tokens,
                           np.asarray([len(req.ids)], np.int32),
                           np.asarray([req.seed_index & 0xFFFFFFFF], np.uint32), self.base_key,
                           sampling=self.sampling, eos_ids=self.eos_ids, max_new_tokens=self.max_new_tokens)
      self.stats["prefills"] += 1

  def _prefill_width(self, n: int) -> int:
    return min(max(PREFILL_MIN_WIDTH, _pow2_at_least(n)), self.cache_slots)

  def _read_bound(self, longest: int) -> int:
    return min(-(-longest // READ_BUCKET) * READ_BUCKET, self.cache_slots)

  def warmup(self) -> float:
    """Compiles every prefill width and read bound this engine can use (before timing it); returns seconds.

    Runs on a scratch copy of the empty state, so queued requests and results are untouched.
    """
    tic = time.perf_counter()
    t, keep = self.target, self.state
    widths = sorted({self._prefill_width(n) for n in (1, *[1 << i for i in range(4, 16)], self.max_prompt_tokens)
                     if n <= self.max_prompt_tokens})
    bounds = sorted({self._read_bound(b) for b in range(READ_BUCKET, self.cache_slots + READ_BUCKET, READ_BUCKET)})
    self.state = jax.tree.map(jnp.copy, keep)
    for width in widths:
      self.state = _insert(t.graphdef, t.params, self.state, np.asarray([self.slots], np.int32),
                           np.zeros((1, width), np.int32), np.ones(1, np.int32), np.zeros(1, np.uint32),
                           self.base_key, sampling=self.sampling, eos_ids=self.eos_ids,
                           max_new_tokens=self.max_new_tokens)
    for bound in bounds:
      self.state = decode_steps(t.graphdef, t.params, self.state, self.base_key, sampling=self.sampling,
                                eos_ids=self.eos_ids, steps=self.chunk_steps, read_slots=bound)
    jax.block_until_ready(self.state)
    self.state = keep
    return time.perf_counter() - tic

  def step(self) -> list[Finished]:
    """Refills free rows, decodes one chunk, and returns the requests that finished."""
    tic = time.perf_counter()
    self.refill()
    live = [r for r in range(self.slots) if self.rows[r] is not None]
    if not live:
      return []
    done, count = self._flags()
    retire = np.zeros(self.slots, bool)
    finished = self._collect(done, count, retire, check_stop=False)
    live = [r for r in range(self.slots) if self.rows[r] is not None]
    if live:
      read = self._read_bound(max(int(self.prompt_len[r] + count[r] - 1) for r in live) + self.chunk_steps)
      t = self.target
      self.state = decode_steps(t.graphdef, t.params, self.state, self.base_key, sampling=self.sampling,
                                eos_ids=self.eos_ids, steps=self.chunk_steps, read_slots=read)
      self.stats["chunks"] += 1
      self.stats["row_steps"] += self.slots * self.chunk_steps
      done, count = self._flags()
      finished += self._collect(done, count, retire, check_stop=True)
      if retire.any():  # stopped rows with no request to replace them must not keep decoding
        self.state = self.state.replace(done=self.state.done | sharding.from_host(retire, self.state.done.sharding))
    self.stats["seconds"] += time.perf_counter() - tic
    self._log()
    return finished

  def _flags(self) -> tuple[np.ndarray, np.ndarray]:
    """Every row's (done, count), gathered whole on every process: the refill and the collection decide from
    these (and from tokens gathered the same way), so every process takes the same decisions."""
    return sharding.to_host(self.state.done), sharding.to_host(self.state.count)

  def _collect(self, done, count, retire, check_stop) -> list[Finished]:
    rows = [r for r in range(self.slots) if self.rows[r] is not None]
    if not rows:
      return []
    tokens = None
    out = []
    for r in rows:
      stop = False
      if not done[r]:
        if not (check_stop and self.stop_fn is not None):
          continue
        if tokens is None:
          tokens = sharding.to_host(self.state.tokens)
        stop = bool(self.stop_fn(tokens[r, :count[r]].tolist()))
        if not stop:
          continue
      if tokens is None:
        tokens = sharding.to_host(self.state.tokens)
      row = tokens[r, :count[r]].tolist()
      if stop:
        reason = "stop"
        retire[r] = True
        self.stats["stopped"] += 1
      else:
        reason = "eos" if row and row[-1] in self.eos_ids else "length"
      out.append(Finished(self.rows[r], row, reason))
      self.rows[r] = None
      self.stats["finished"] += 1
      self.stats["tokens"] += len(row)
    return out

  def _log(self) -> None:
    if not self.log_every or time.perf_counter() - self._last_log < self.log_every:
      return
    self._last_log = time.perf_counter()
    s = self.stats
    rate = s["finished"] / max(s["seconds"], 1e-9)
    left = len(self.queue) + sum(r is not None for r in self.rows)
    logging.info("continuous batching: %d requests done, %d queued or decoding; %.1f tokens/s, %.0f%% of row "
                 "steps used; ETA %.0f s for the queue.", s["finished"], left,
                 s["tokens"] / max(s["seconds"], 1e-9), 100 * s["tokens"] / max(s["row_steps"], 1),
                 left / max(rate, 1e-9))

  def run(self) -> list[Finished]:
    """Steps until every submitted request has finished; returns them in finishing order."""
    out = []
    while self.busy:
      out += self.step()
    return out


def generate_continuous(target: Target, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, slots: int,
                        *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                        ignore_eos: bool = False, stop_fn=None, chunk_steps: int = 16,
                        return_stats: bool = False, log_every: float = 0.0):
  """`layerwave.generate(..., slots=B)`: every prompt's new tokens, in input order (see the module docstring).

  `slots` larger than the number of prompts uses fewer rows (rounded up to the data axis). Prompt i samples
  from random stream i.
  """
  if isinstance(prompt_ids, np.ndarray):
    prompt_ids = prompt_ids.tolist()
  if not prompt_ids or isinstance(prompt_ids[0], (int, np.integer)):
    raise ValueError("prompt_ids must be a non-empty list of token-id lists (one per prompt).")
  for i, p in enumerate(prompt_ids):
    if len(p) == 0:
      raise ValueError(f"Prompt {i} is empty: every prompt needs at least one token.")
  data = sharding.data_size(target.mesh)
  if int(slots) == slots and slots >= 1 and slots % data == 0:
    slots = min(int(slots), -(-len(prompt_ids) // data) * data)
  engine = Engine(target, slots, max_new_tokens, max(len(p) for p in prompt_ids), temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed, ignore_eos=ignore_eos, stop_fn=stop_fn,
                  chunk_steps=chunk_steps, log_every=log_every)
  for i, p in enumerate(prompt_ids):
    engine.submit(Request(ids=p, seed_index=i, tag=i))
  results: list[list[int] | None] = [None] * len(prompt_ids)
  for f in engine.run():
    results[f.request.tag] = f.tokens
  return (results, dict(engine.stats)) if return_stats else results
