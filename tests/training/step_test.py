"""The jitted online train step: loss falls on a tiny overfit, one compile, 8 devices equal one, its metrics."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layerwave
from layerwave import sharding
from layerwave.models.draft import Draft, DraftConfig
from layerwave.training import losses
from layerwave.training import step as step_lib
from layerwave.training.options import TrainOptions

from tests.models import hf_reference
from tests.multidevice import run_on_eight_devices

torch = pytest.importorskip("torch")


def make_peaky_target(directory):
  """A random tiny target with a sharpened LM head: near one-hot next-token distributions."""
  model = hf_reference.make_hf_model("llama", seed=5)
  with torch.no_grad():
    model.lm_head.weight.mul_(30.0)
  model.save_pretrained(directory, safe_serialization=True)
  return layerwave.load_target(directory)


def setup(target, batch_size=4, t=16, seed=0, fsdp=False):
  cfg = DraftConfig.from_target(target.config, (1, 2, 3), draft_vocab_size=97)
  draft = Draft(cfg, embedding=target.params["embed_tokens"]["embedding"][...],
                rngs=nnx.Rngs(seed))
  graphdef, params, vocab, embed = step_lib.split_draft(draft)
  optimizer = step_lib.OptimizerSettings(3e-3, 5, 400)
  rep = sharding.replicated(target.mesh)
  state = step_lib.init_state(params, optimizer)
  state = jax.device_put(state, step_lib.state_shardings(state, target.mesh) if fsdp else rep)
  vocab, embed = jax.device_put(vocab, rep), jax.device_put(embed, rep)
  rng = np.random.default_rng(seed)
  batch = {"input_ids": rng.integers(3, 97, (batch_size, t)).astype(np.int32),
           "attention_mask": np.ones((batch_size, t), np.int32),
           "assistant_mask": np.ones((batch_size, t), np.int32)}
  batch["attention_mask"][1, 12:] = 0
  batch = jax.device_put(batch, sharding.batch_sharding(target.mesh))
  kw = dict(program=step_lib.StepProgram(graphdef, step_lib.LossSettings(steps=3, decay=0.8, assistant_only=True),
                                         optimizer=optimizer, target_graphdef=target.graphdef))
  return state, vocab, embed, batch, kw


def _with(kw, **changes):
  """`kw` with its program's fields (or its loss's: `steps`, `compute_dtype`, `remat`) replaced."""
  program = kw["program"]
  loss = {k: changes.pop(k) for k in ("steps", "compute_dtype", "remat") if k in changes}
  return dict(kw, program=dataclasses.replace(program, loss=dataclasses.replace(program.loss, **loss), **changes))


def test_loss_falls_and_step_compiles_once(tmp_path):
  target = make_peaky_target(str(tmp_path))
  state, vocab, embed, batch, kw = setup(target)
  chex.clear_trace_counter()
  # The library's step function and static arguments, in a fresh jit that fails on a second trace.
  step = jax.jit(chex.assert_max_traces(step_lib.train_step.__wrapped__, n=1), static_argnames=("program",))
  history = []
  for i in range(120):
    if i == 60:  # an equal optimizer built anew (a resumed run, the next compare cell): no recompile
      kw = _with(kw, optimizer=dataclasses.replace(kw["program"].optimizer))
    state, m = step(state, vocab, embed, target.params, batch, **kw)
    history.append((float(m["loss"]), np.asarray(m["acc_j"])))
  first, last = history[0], history[-1]
  assert last[0] < 0.45 * first[0]  # the floor is the target's own entropy (~1.8 nats a step)
  assert last[1].min() > 0.85 and first[1].max() < 0.1  # memorised the batch, later steps too
  assert int(state.step) == 120


def test_sim_tau_is_per_batch_in_training_and_left_to_the_pooled_evaluation(tmp_path):
  target = make_peaky_target(str(tmp_path))
  state, vocab, embed, batch, kw = setup(target)
  eval_kw = _with(kw, optimizer=None)
  e = step_lib.eval_step(state.params, vocab, embed, target.params, batch, **eval_kw)
  assert "sim_tau" not in e and {"hits_j", "tokens_j", "in_vocab_j"} <= set(e)  # training.loop pools these
  _, m = step_lib.train_step(state, vocab, embed, target.params, batch, **kw)
  np.testing.assert_allclose(m["sim_tau"], losses.simulated_tau(m["acc_j"]), rtol=1e-6)


SCRIPT = """
    import numpy as np
    from tests.training import step_test
    from layerwave import sharding
    from layerwave.training import step as step_lib
    target = layerwave.load_target(ARGS[0])
    state, vocab, embed, batch, kw = step_test.setup(target, batch_size=8)
    for _ in range(3):
      state, m = step_lib.train_step(state, vocab, embed, target.params, batch, **kw)
    leaves = [np.asarray(x).tolist() for x in jax.tree.leaves(state.params)]
    # The scale layout: the target split over 'model', the draft's state over all 8 devices (FSDP), its step's
    # batch spread over every device, steps rematerialised.
    mesh = sharding.make_mesh((("data", 2), ("model", 4)))
    split = layerwave.load_target(ARGS[0], mesh=mesh)
    state, vocab, embed, batch, kw = step_test.setup(split, batch_size=8, fsdp=True)
    for _ in range(3):
      state, m2 = step_lib.train_step(state, vocab, embed, split.params, batch,
                                      **step_test._with(kw, remat=True, mesh=mesh))
    fc = state.params["fc"]["kernel"][...]
    write_result({"params": leaves, "loss": float(m["loss"]), "fsdp_loss": float(m2["loss"]),
                  "fsdp_params": [np.asarray(x).tolist() for x in jax.tree.leaves(state.params)],
                  "fc_spec": [list(a) if isinstance(a, tuple) else a for a in fc.sharding.spec],
                  "fc_shard_rows": fc.addressable_shards[0].data.shape[0]})
"""


def test_eight_devices_equal_one(tmp_path):
  target = make_peaky_target(str(tmp_path / "model"))
  got = run_on_eight_devices(SCRIPT, tmp_path, tmp_path / "model")
  state, vocab, embed, batch, kw = setup(target, batch_size=8)
  for _ in range(3):
    state, m = step_lib.train_step(state, vocab, embed, target.params, batch, **kw)
  assert abs(got["loss"] - float(m["loss"])) < 1e-4
  for a, b in zip(got["params"], jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, b, atol=2e-5)
  # FSDP state + spread batch + remat on (data 2, model 4) follows the one-device step too, and the state stays
  # split over every device after the update.
  assert abs(got["fsdp_loss"] - float(m["loss"])) < 1e-4
  for a, b in zip(got["fsdp_params"], jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, b, atol=2e-5)
  assert ["data", "model"] in got["fc_spec"]  # the fc kernel [3 * D, D] split over all 8 devices
  assert got["fc_shard_rows"] in (3 * 32 // 8, 3 * 32)


def test_remat_keeps_the_loss_and_the_gradients_to_rounding(tmp_path):
  target = make_peaky_target(str(tmp_path))
  state, vocab, embed, batch, kw = setup(target)
  fn = jax.jit(jax.value_and_grad(step_lib._loss_fn, has_aux=True),  # pylint: disable=protected-access
               static_argnums=(5,))
  args = (state.params, vocab, embed, target.params, batch)
  (loss, _), grads = fn(*args, _with(kw, optimizer=None)["program"])
  (loss_r, _), grads_r = fn(*args, _with(kw, optimizer=None, remat=True)["program"])
  assert float(loss_r) == float(loss)
  for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_freeze_head_leaves_the_lm_head_and_trains_the_rest(tmp_path):
  target = make_peaky_target(str(tmp_path))
  state, vocab, embed, batch, kw = setup(target)
  frozen = step_lib.OptimizerSettings(3e-3, 5, 400, freeze_head=True)
  state = jax.device_put(step_lib.init_state(state.params, frozen), sharding.replicated(target.mesh))
  before = jax.device_get(state.params)
  for _ in range(3):
    state, m = step_lib.train_step(state, vocab, embed, target.params, batch, **_with(kw, optimizer=frozen))
  after = jax.device_get(state.params)
  np.testing.assert_array_equal(after["lm_head"]["kernel"][...], before["lm_head"]["kernel"][...])
  assert not np.array_equal(after["fc"]["kernel"][...], before["fc"]["kernel"][...])
  assert np.isfinite(float(m["loss"]))


def test_bfloat16_compute_keeps_float32_state_and_follows_the_float32_step(tmp_path):
  """`compute_dtype="bfloat16"`: the draft's matmuls run in bfloat16 (the compiled step holds bf16 dots), the
  parameters, gradients and optimizer state stay float32, the first loss is the float32 one to bfloat16's
  precision, and the loss falls on the overfit as in float32."""
  target = make_peaky_target(str(tmp_path))
  state, vocab, embed, batch, kw = setup(target)
  bf16 = _with(kw, compute_dtype="bfloat16")
  hlo = step_lib.train_step.lower(state, vocab, embed, target.params, batch, **bf16).as_text()
  assert "bf16" in hlo and "bf16" not in step_lib.train_step.lower(
      state, vocab, embed, target.params, batch, **kw).as_text()
  _, m32 = step_lib.train_step(jax.tree.map(np.array, state), vocab, embed, target.params, batch, **kw)
  history = []
  for _ in range(60):
    state, m = step_lib.train_step(state, vocab, embed, target.params, batch, **bf16)
    history.append(float(m["loss"]))
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
  assert all(x.dtype in (np.float32, np.int32) for x in jax.tree.leaves(state.opt_state))
  assert abs(history[0] - float(m32["loss"])) < 0.02 * float(m32["loss"])
  assert history[-1] < 0.6 * history[0] and np.isfinite(float(m["grad_norm"]))


def test_an_unknown_compute_dtype_is_refused():
  with pytest.raises(ValueError, match=r"train.compute_dtype must be one of \['float32', 'bfloat16'\].*float32"):
    TrainOptions(batch_size=8, num_steps=10, compute_dtype="float16")


@pytest.mark.parametrize("warmup, total", [(0, 1), (1, 1), (5, 3)])
def test_a_run_no_longer_than_its_warmup_still_builds_its_schedule(warmup, total):
  """A ¼× dynamics cell of a short budget has 1 step: the schedule must build and give finite updates."""
  tx = step_lib.OptimizerSettings(3e-3, warmup, total).build()
  params = {"w": jnp.ones((3,))}
  state = tx.init(params)
  for _ in range(total + 1):
    updates, state = tx.update({"w": jnp.full((3,), 0.5)}, state, params)
    assert np.all(np.isfinite(np.asarray(updates["w"])))
