"""Fault injection: NaN in a checkpoint, a gradient, the rollouts; a raising reward; resume with a changed config;
two runs on one output_dir; truncated checkpoint files. Each asserts what survives (docs/checkpoints.md, "Faults and
what survives them"), and that no parameter is ever non-finite after a guarded step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from marble_runs import REWARDS, STEPS, make_trainer, snapshot
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback

from marble_trl.artifacts import EMA_FILE, LORA_FILE, OLD_POLICY_FILE
from marble_trl.persistence.output_dir import LOCK_FILE, OutputDirLock, OutputDirLockedError
from marble_trl.persistence.resume import CorruptCheckpointError, resolve_resume, validate_checkpoint
from marble_trl.policy.lora import OLD_ADAPTER, TRAIN_ADAPTER, lora_parameters

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")


def _finite(trainer) -> bool:
    params = [*lora_parameters(trainer.transformer, TRAIN_ADAPTER).values()]
    params += [*lora_parameters(trainer.transformer, OLD_ADAPTER).values()]
    return all(torch.isfinite(p).all() for p in params)


def _copy_checkpoints(reference_run, out: Path, steps=(3, 6)) -> None:
    out.mkdir(parents=True)
    for step in steps:
        shutil.copytree(reference_run.checkpoint(step), out / f"checkpoint-{step}")


def _poison(path: Path) -> None:
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------ NaN in a checkpoint
@pytest.mark.parametrize("file", [LORA_FILE, OLD_POLICY_FILE, EMA_FILE])
def test_nan_in_a_checkpoint_is_named_and_resume_true_falls_back(reference_run, tmp_path, file):
    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out)
    _poison(out / "checkpoint-6" / file)
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint-6/{file}.*non-finite"):
        validate_checkpoint(out / "checkpoint-6")
    assert resolve_resume(out, True) == str(out / "checkpoint-3")  # the newest *valid* one
    with pytest.raises(CorruptCheckpointError, match=file):
        make_trainer(out).train(resume_from_checkpoint=str(out / "checkpoint-6"))


@pytest.mark.parametrize(
    "file", [LORA_FILE, OLD_POLICY_FILE, EMA_FILE, "optimizer.pt", "rng_state.pth", "trainer_state.json",
             "marble_balancer.json", "marble_checkpoint.json"],
)  # fmt: skip
def test_truncated_checkpoint_files_are_named(reference_run, tmp_path, file):
    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out)
    path = out / "checkpoint-6" / file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint-6/{file}"):
        validate_checkpoint(out / "checkpoint-6")
    assert resolve_resume(out, True) == str(out / "checkpoint-3")


def test_resume_true_with_no_valid_checkpoint_lists_every_problem(reference_run, tmp_path):
    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out)
    for step in (3, 6):
        (out / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpointError, match="(?s)no checkpoint .* is valid.*checkpoint-6.*checkpoint-3"):
        resolve_resume(out, True)


# ------------------------------------------------------------------------------------------ NaN during training
class NaNGradientAt(TrainerCallback):
    """Poisons one LoRA gradient right before the optimizer step of the given (0-based) steps."""

    def __init__(self, trainer_ref: list, steps: set[int]) -> None:
        self.trainer_ref, self.steps, self.seen = trainer_ref, steps, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer_ref[0]
        self.seen.append(
            (snapshot(trainer, TRAIN_ADAPTER), snapshot(trainer, OLD_ADAPTER), dict(trainer.param_ema.state_dict()))
        )
        if state.global_step in self.steps:
            param = next(p for p in trainer.trainable_parameters().values() if p.grad is not None)
            param.grad.view(-1)[0] = float("nan")


def _run_with_nan_gradients(tmp_path, steps: set[int], max_skips: int, max_steps: int = 4):
    ref: list = []
    poison = NaNGradientAt(ref, steps)
    trainer = make_trainer(tmp_path / "run", callbacks=[poison], max_steps=max_steps, max_nonfinite_skips=max_skips)
    ref.append(trainer)
    return trainer, poison


def test_a_nan_gradient_skips_the_step_and_training_goes_on(tmp_path):
    trainer, poison = _run_with_nan_gradients(tmp_path, steps={1}, max_skips=1)
    trainer.train()
    assert trainer.state.global_step == 4 and _finite(trainer)
    # the skipped step (index 1) moved nothing: the state before step 2 equals the state before step 1's update ...
    (lora1, old1, ema1), (lora2, old2, ema2) = poison.seen[1], poison.seen[2]
    for n in lora1:
        assert torch.equal(lora2[n], lora1[n]), n
    for n in old1:
        assert torch.equal(old2[n], old1[n]), n
    for n in ema1:
        assert torch.equal(ema2[n], ema1[n]), n
    # ... while the next steps train again
    assert any(not torch.equal(poison.seen[3][0][n], lora2[n]) for n in lora2)
    skipped = [h["nonfinite/skipped_steps"] for h in trainer.state.log_history if "loss" in h]
    assert skipped == [0.0, 1.0, 0.0, 0.0]  # per step (logging_steps 1): the second was skipped


def test_consecutive_nan_steps_stop_the_run_with_finite_weights_and_no_nan_checkpoint(tmp_path, caplog):
    trainer, _ = _run_with_nan_gradients(tmp_path, steps={1, 2}, max_skips=1)
    with pytest.raises(FloatingPointError, match="2 consecutive non-finite step"):
        trainer.train()
    assert _finite(trainer)
    # the emergency checkpoint holds the last finite state (after step 1), and it validates
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert trainer.emergency_checkpoint == str(checkpoint)
    validate_checkpoint(checkpoint)


def test_a_nan_update_is_rolled_back(tmp_path):
    """Finite gradients, but an update that overflows (an absurd learning rate): parameters and optimizer state are
    restored from the copy taken before the step."""

    class Overflow(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:
                for group in trainer.optimizer.param_groups:
                    group["lr"] = float("inf")

        def on_step_end(self, args, state, control, **kwargs):
            for group in trainer.optimizer.param_groups:
                group["lr"] = args.learning_rate

    trainer = make_trainer(tmp_path / "run", callbacks=[Overflow()], max_steps=3, max_nonfinite_skips=1,
                           lr_scheduler_type="constant")  # fmt: skip
    trainer.train()
    assert _finite(trainer) and trainer.nonfinite_guard.total == 1
    state = trainer.optimizer.optimizer.state if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer.state
    assert all(torch.isfinite(v).all() for s in state.values() for v in s.values() if torch.is_tensor(v))


def test_nan_rollouts_are_an_error_not_not_applicable(tmp_path):
    trainer = make_trainer(tmp_path / "run", max_steps=1)
    with torch.no_grad():
        next(iter(lora_parameters(trainer.transformer, OLD_ADAPTER).values())).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="rollouts' latents contain NaN"):
        trainer.train()


# ------------------------------------------------------------------------------------------ a raising reward
def test_an_error_after_the_optimizer_step_saves_no_checkpoint_of_mixed_weights(tmp_path, caplog):
    """The old-policy update raises in step 3, after the optimizer moved the weights but before the step ended: an
    emergency checkpoint-2 would hold step 3's weights under step 2's number (and a half-updated old policy). None is
    written, and the error says why."""
    out = tmp_path / "run"
    trainer = make_trainer(out, max_steps=4)
    update = trainer.old_policy.update

    def failing(transformer, eta):
        if trainer.state.global_step == 2:  # step 3 (1-based), global_step not yet advanced
            raise RuntimeError("disk error while copying the old policy")
        return update(transformer, eta)

    trainer.old_policy.update = failing
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match="disk error"):
        trainer.train()
    assert trainer.emergency_checkpoint is None and not (out / "checkpoint-2").exists()
    assert "the optimizer had already stepped in step 3" in caplog.text


def test_a_raising_reward_leaves_an_emergency_checkpoint_that_resumes_exactly(reference_run, tmp_path):
    """The reward raises on its 4th call (step 4) under save_strategy="no": checkpoint-3 is written anyway, and the
    run resumed from it ends where the uninterrupted reference run ends."""
    calls = []

    def flaky(prompts, images, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("reward server down")
        return REWARDS[0](prompts, images, **kwargs)

    flaky.__name__ = REWARDS[0].__name__
    out = tmp_path / "run"
    broken = make_trainer(out, rewards=[flaky, *REWARDS[1:]])
    with pytest.raises(Exception, match="reward server down"):
        broken.train()
    assert broken.emergency_checkpoint == str(out / "checkpoint-3")
    assert not (out / LOCK_FILE).exists()  # released on the error
    resumed = make_trainer(out)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS
    lora = snapshot(resumed, TRAIN_ADAPTER)
    for name, value in reference_run.lora.items():
        torch.testing.assert_close(lora[name], value, rtol=0, atol=0)


def test_cli_writes_what_it_has_when_training_fails(tmp_path):
    """marble-trl train with a reward that raises mid-run: exit non-zero, but the LoRA, metrics.jsonl and a
    run_summary.json with the error are there (save_strategy "no")."""
    out = tmp_path / "run"
    (tmp_path / "flaky_reward.py").write_text(
        "calls = []\n\n\ndef flaky(prompts, images, **columns):\n    calls.append(1)\n"
        "    if len(calls) == 3:\n        raise RuntimeError('reward server down')\n"
        "    return images.float().mean(dim=(1, 2, 3)).tolist()\n"
    )
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-random.yaml"
    cmd = [sys.executable, "-m", "marble_trl.cli", "train", "--config", str(recipe), "--output_dir", str(out),
           "--reward_funcs", "flaky_reward:flaky", "--max_steps", "5", "--sample_grid_prompts", "0",
           "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "reward server down" in proc.stderr
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["global_step"] == 2 and "reward server down" in summary["error"]
    assert summary["emergency_checkpoint"].endswith("checkpoint-2")
    assert (out / LORA_FILE).is_file() and (out / "checkpoint-2" / LORA_FILE).is_file()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]


# ------------------------------------------------------------------------------------------ resume with changes
def test_resume_with_a_changed_learning_rate_is_refused_or_applied(reference_run, tmp_path):
    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out, steps=(3,))
    with pytest.raises(ValueError, match=r"learning_rate 0\.02 -> 0\.05.*resume_allow_changes"):
        make_trainer(out, learning_rate=0.05).train(resume_from_checkpoint=True)
    trainer = make_trainer(out, learning_rate=0.05, resume_allow_changes=["learning_rate"], max_steps=4)
    trainer.train(resume_from_checkpoint=True)
    logged = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    assert logged[-1] == pytest.approx(0.05)  # step 4 used the new rate (constant schedule), not the checkpoint's 0.02
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert [g["lr"] for g in inner.param_groups] == [pytest.approx(0.05)] * len(inner.param_groups)


@pytest.mark.parametrize(
    ("change", "expected"),
    [({"seed": 1}, "seed 0 -> 1"), ({"num_generations": 2, "prompts_per_step": 4}, "num_generations 4 -> 2"),
     ({"nft_beta": 0.5}, "nft_beta 1.0 -> 0.5"), ({"reward_weights": [1.0, 2.0, 1.0]}, "reward_weights")],
)  # fmt: skip
def test_resume_with_a_changed_exactness_field_is_refused(reference_run, tmp_path, change, expected):
    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out, steps=(3,))
    with pytest.raises(ValueError, match=expected):
        make_trainer(out, **change).train(resume_from_checkpoint=True)


def test_resume_with_another_dataset_is_refused(reference_run, tmp_path):
    from datasets import Dataset
    from marble_runs import small_args

    from marble_trl import MarbleDiffusionNFTTrainer

    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out, steps=(3,))
    other = Dataset.from_dict({"prompt": ["a red apple", "a blue car", "a green frog", "a black dog"]})
    trainer = MarbleDiffusionNFTTrainer("tiny", list(REWARDS), args=small_args(out), train_dataset=other)
    with pytest.raises(ValueError, match="train_dataset 'fingerprint [0-9a-f]+' -> 'fingerprint"):
        trainer.train(resume_from_checkpoint=True)


def test_resume_allow_changes_rejects_unknown_fields(tmp_path):
    with pytest.raises(ValueError, match="resume_allow_changes names \\['max_steps'\\]"):
        make_trainer(tmp_path, resume_allow_changes=["max_steps"])


# ------------------------------------------------------------------------------------------ one run per output_dir
_HOLD_LOCK = """
import sys, time
from marble_trl.persistence.output_dir import OutputDirLock
lock = OutputDirLock(sys.argv[1]); lock.acquire(); print("locked", flush=True); time.sleep(float(sys.argv[2]))
"""


def test_a_second_run_on_a_busy_output_dir_fails_at_start(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        trainer = make_trainer(out, max_steps=1)
        with pytest.raises(OutputDirLockedError, match=f"pid {holder.pid}"):
            trainer.train()
        assert trainer.state.global_step == 0
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # the holder was killed: its lock is stale, and the next run takes it over
    make_trainer(out, max_steps=1).train()
    assert not (out / LOCK_FILE).exists()


def test_lock_of_a_live_process_on_another_host_is_respected(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "another-host", "started": "x"}))
    with pytest.raises(OutputDirLockedError, match="another-host.*take_over_lock=True"):
        OutputDirLock(tmp_path).acquire()


def test_a_lock_whose_heartbeat_outlived_its_lease_is_taken_over(tmp_path, caplog):
    """A SIGKILLed run's lock on another host was never stale: a requeued job on another node needed it deleted by
    hand. Its heartbeat stops with it, so after the lease the lock is taken over."""
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": 1, "host": "dead-node", "started": "x", "lease_s": 60}))
    old = time.time() - 120
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING", logger="marble_trl.persistence.output_dir"):
        with OutputDirLock(tmp_path):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "heartbeat is 120 s old (lease 60 s)" in caplog.text


def test_a_requeued_job_takes_over_its_own_lock_and_force_takes_any(tmp_path, monkeypatch):
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": 1, "host": "node-a", "started": "x", "job": "SLURM_JOB_ID=42"}))
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    with pytest.raises(OutputDirLockedError):
        OutputDirLock(tmp_path).acquire()  # another job's: live (fresh heartbeat), refused
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with OutputDirLock(tmp_path):  # the same job, requeued on another node
        assert json.loads(lock.read_text())["job"] == "SLURM_JOB_ID=42"
    lock.write_text(json.dumps({"pid": 1, "host": "node-b", "started": "x"}))
    with OutputDirLock(tmp_path, take_over=True):
        pass
    assert not lock.exists()


def test_a_held_lock_heartbeats(tmp_path):
    with OutputDirLock(tmp_path, lease_s=0.3):
        lock = tmp_path / LOCK_FILE
        first = lock.stat().st_mtime
        old = first - 100
        os.utime(lock, (old, old))
        time.sleep(0.35)
        assert lock.stat().st_mtime > old + 50  # touched again by the heartbeat thread
    assert not lock.exists()


def test_a_fresh_run_does_not_overwrite_an_earlier_runs_checkpoints(reference_run, tmp_path):
    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out, steps=(3,))
    with pytest.raises(FileExistsError, match="overwrite_output_dir"):
        make_trainer(out, max_steps=1).train()
    make_trainer(out, max_steps=1, overwrite_output_dir=True).train()


def test_a_fresh_run_does_not_overwrite_a_finished_run_without_checkpoints(tmp_path):
    """save_strategy "no" (the default and the recipes'): the finished run's LoRA and manifest were replaced silently."""
    out = tmp_path / "run"
    first = make_trainer(out, max_steps=1, save_strategy="no")
    first.train()
    first.save_model(str(out))
    lora = (out / LORA_FILE).read_bytes()
    with pytest.raises(FileExistsError, match="already holds a finished run.*overwrite_output_dir"):
        make_trainer(out, max_steps=1, save_strategy="no").train()
    assert (out / LORA_FILE).read_bytes() == lora
    make_trainer(out, max_steps=1, save_strategy="no", overwrite_output_dir=True).train()


def test_a_user_lora_config_with_zero_alpha_is_refused(tmp_path):
    from datasets import Dataset
    from marble_runs import small_args
    from peft import LoraConfig

    from marble_trl import MarbleDiffusionNFTTrainer

    config = LoraConfig(r=4, lora_alpha=0, target_modules=["attn.to_q"])
    with pytest.raises(ValueError, match="lora_alpha is 0"):
        MarbleDiffusionNFTTrainer(
            "tiny",
            list(REWARDS),
            args=small_args(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["a cat"]}),
            peft_config=config,
        )


def test_a_diverging_loss_is_warned_about(tmp_path, caplog):
    trainer = make_trainer(tmp_path / "run", max_steps=4, learning_rate=1e4, max_nonfinite_skips=4)
    with caplog.at_level("WARNING", logger="marble_trl.trainer.guards"):
        try:
            trainer.train()
        except FloatingPointError:
            pass  # it may end non-finite as well: that is the guard's other job
    assert caplog.text.count("training is diverging") == 1  # measured: the loss reaches ~7e14 at step 3
    assert _finite(trainer)


def test_a_failure_before_training_leaves_the_folder_alone(reference_run, tmp_path):
    """A run refused at start (here: an occupied output_dir) must not overwrite the folder's own metrics.jsonl and
    run_summary.json with its empty ones."""
    from marble_trl.commands.train import _save_after_failure

    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out, steps=(3,))
    (out / "metrics.jsonl").write_text('{"step": 3}\n')
    (out / "run_summary.json").write_text('{"global_step": 3}\n')
    trainer = make_trainer(out, max_steps=1)
    with pytest.raises(FileExistsError) as info:
        trainer.train()
    _save_after_failure(trainer, out, info.value, 0.0)
    assert (out / "metrics.jsonl").read_text() == '{"step": 3}\n'
    assert json.loads((out / "run_summary.json").read_text()) == {"global_step": 3}


def test_a_nan_loss_refreshes_no_marble_coefficients(tmp_path, monkeypatch):
    """A refresh step whose loss is flagged non-finite is skipped whole: the balancer does not move either."""
    import marble_trl.trainer.backward as nft_trainer

    trainer = make_trainer(tmp_path / "run", max_steps=1, max_nonfinite_skips=1)
    before = json.dumps(trainer.balancer.state_dict(), sort_keys=True)
    original = nft_trainer.nft_loss

    def nan_loss(*args, **kwargs):
        return original(*args, **kwargs) * float("nan")

    monkeypatch.setattr(nft_trainer, "nft_loss", nan_loss)
    trainer.train()
    assert trainer.nonfinite_guard.total == 1 and _finite(trainer)
    assert json.dumps(trainer.balancer.state_dict(), sort_keys=True) == before


def test_finite_garbage_in_a_checkpoint_fails_its_sha256_and_resume_true_falls_back(reference_run, tmp_path):
    """A LoRA whose bytes changed but still read as finite weights (it resumed silently before): the manifest's
    SHA-256 of every file names it, resume=True takes the previous checkpoint, and export refuses it."""
    from marble_trl.publish.export import export_checkpoint

    out = tmp_path / "run"
    _copy_checkpoints(reference_run, out)
    manifest = json.loads((out / "checkpoint-6" / "marble_checkpoint.json").read_text())
    assert set(manifest["sha256"]) >= {LORA_FILE, OLD_POLICY_FILE, "optimizer.pt", "trainer_state.json"}
    path = out / "checkpoint-6" / LORA_FILE
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.5  # finite, plausible, wrong
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint-6/{LORA_FILE} does not match its SHA-256"):
        validate_checkpoint(out / "checkpoint-6")
    assert resolve_resume(out, True) == str(out / "checkpoint-3")
    with pytest.raises(ValueError, match=f"Not exporting .*checkpoint-6.*{LORA_FILE} does not match"):
        export_checkpoint(out / "checkpoint-6", tmp_path / "exported")


def test_the_manifest_records_the_lora_a_peft_config_trained(tmp_path):
    """A LoraConfig given to the trainer overrides the config's lora_* defaults: the checkpoint's manifest records
    r 4 / alpha 8 / the given targets (it recorded the unused defaults, r 32 and alpha 64), and a resume with the same
    LoraConfig is accepted."""
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["attn.to_q", "attn.to_v"], init_lora_weights="gaussian")
    out = tmp_path / "run"
    make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1, peft_config=config).train()
    manifest = json.loads((out / "checkpoint-1" / "marble_checkpoint.json").read_text())
    args = manifest["training_args"]
    assert (args["lora_r"], args["lora_alpha"], args["lora_target_modules"]) == (4, 8, ["attn.to_q", "attn.to_v"])
    assert manifest["lora_config"]["r"] == 4
    resumed = make_trainer(out, max_steps=2, save_strategy="no", peft_config=config)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert resumed.state.global_step == 2


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_any_byte_is_written(tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    out = tmp_path / "run"
    make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1).train()
    size = sum(p.stat().st_size for p in (out / "checkpoint-1").rglob("*") if p.is_file())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10**9, 10**9 - size // 2, size // 2))
    trainer = make_trainer(out, max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.raises(
        OSError, match=r"Not enough free space to write .*checkpoint-2: it needs about [\d,]+ bytes"
    ) as err:
        trainer.train(resume_from_checkpoint=True)
    assert "The last intact checkpoint is" in str(err.value) and "checkpoint-1" in str(err.value)
    assert not list(out.glob("tmp-checkpoint-*"))  # nothing partial left behind
    validate_checkpoint(out / "checkpoint-1")


def test_a_save_that_fails_midway_removes_its_partial_folder_and_names_the_intact_checkpoint(tmp_path, monkeypatch):
    import marble_trl.trainer.checkpointing as checkpointing

    out = tmp_path / "run"
    make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1).train()

    def disk_full(trainer, folder):
        (Path(folder) / "old_policy_lora.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing, "save_training_state", disk_full)
    trainer = make_trainer(out, max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.raises(OSError, match=r"checkpoint-2 failed \(OSError: \[Errno 28\].*partial files were removed"):
        trainer.train(resume_from_checkpoint=True)
    assert not list(out.glob("tmp-checkpoint-*")) and not (out / "checkpoint-2").exists()
    validate_checkpoint(out / "checkpoint-1")
