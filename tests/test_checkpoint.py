"""Checkpoints: exact resume, atomic writes (a process killed mid-save), save_total_limit, SIGTERM / SIGINT."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from marble_runs import REWARDS, make_trainer, recording, redness
from safetensors.torch import load_file
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from marble_trl.artifacts import BALANCER_FILE, EMA_FILE, LORA_FILE, MANIFEST_FILE, OLD_POLICY_FILE
from marble_trl.persistence.checkpoint import read_manifest
from marble_trl.policy.lora import OLD_ADAPTER, TRAIN_ADAPTER, lora_parameters
from marble_trl.trainer.checkpointing import load_training_state

pytestmark = [
    pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning"),
    # The signal tests rely on Python's default handlers, not on the ones the test process inherited: a background
    # job (`python -m pytest &` in a script) starts with SIGINT ignored, and an ignored SIGINT stays ignored.
    pytest.mark.usefixtures("default_signals"),
]
ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
RECIPE = ROOT / "recipes" / "tiny-random.yaml"


class SignalAtStep(TrainerCallback):
    """Sends ``signum`` to this process when step ``step`` ends (as a scheduler's SIGTERM would arrive)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _lora(trainer, adapter):
    return {n: p.detach().clone() for n, p in lora_parameters(trainer.transformer, adapter).items()}


def _logged(log_history, step, prefix=("rewards/", "loss", "marble/alpha", "reward")):
    entry = next(h for h in log_history if h.get("step") == step and "loss" in h)
    return {k: v for k, v in entry.items() if k.startswith(prefix) and not k.endswith("/time")}


def test_resume_after_stop_equals_uninterrupted_run(reference_run, tmp_path):
    """Stopped by SIGTERM after step 3 (mid-epoch 1, between MARBLE refreshes), resumed to step 6: the same LoRA,
    old policy, EMA, coefficients, prompts and logged rewards as the uninterrupted reference run."""
    ref = reference_run
    out = tmp_path / "run"
    seen: list = []
    stopped = make_trainer(out, rewards=recording(REWARDS, seen), callbacks=[SignalAtStep(3)])
    stopped.train()
    assert stopped.stopped_by_signal == "SIGTERM" and stopped.state.global_step == 3
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]  # written although save_strategy="no"
    ckpt = out / "checkpoint-3"
    for name in (LORA_FILE, OLD_POLICY_FILE, EMA_FILE, BALANCER_FILE, MANIFEST_FILE, "optimizer.pt", "scheduler.pt"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / BALANCER_FILE).read_text()) == stopped.balancer.state_dict()
    assert read_manifest(ckpt)["global_step"] == 3

    resumed = make_trainer(out, rewards=recording(REWARDS, seen))
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint of output_dir
    assert resumed.state.global_step == 6 and resumed.stopped_by_signal is None

    assert seen == reference_run.prompts, "the resumed run scored other prompts (data position)"
    for adapter, theirs in ((TRAIN_ADAPTER, ref.lora), (OLD_ADAPTER, ref.old_policy)):
        mine = _lora(resumed, adapter)
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=1e-7, msg=f"{adapter}: {name}")
    for name, value in ref.ema.items():
        torch.testing.assert_close(resumed.param_ema.state_dict()[name], value, rtol=0, atol=1e-7)
    mine, theirs = resumed.balancer.state_dict(), ref.balancer
    assert mine["num_refreshes"] == theirs["num_refreshes"] == 3
    assert mine["alpha_bar"] == pytest.approx(theirs["alpha_bar"], abs=1e-12)
    assert max(abs(a - 1 / 3) for a in theirs["alpha_bar"]) > 1e-3, "uniform coefficients: a vacuous comparison"
    for step in range(1, 7):  # steps 1-3 come from the checkpoint's trainer_state.json, 4-6 were recomputed
        expected = _logged(ref.log_history, step)
        assert "rewards/redness/mean" in expected
        assert _logged(resumed.state.log_history, step) == pytest.approx(expected, rel=1e-6, abs=1e-9), step
    assert "marble/alpha/brightness" in _logged(resumed.state.log_history, 5)  # a refresh after the resume


def test_resuming_a_finished_checkpoint_trains_no_further_step(reference_run, tmp_path):
    """A run killed after its last checkpoint (before its final files) and resumed: the Trainer alone would train a
    step past max_steps; the resume restores the last checkpoint instead (the chaos soak found this)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference_run.checkpoint(6), out / "checkpoint-6")
    seen: list = []
    resumed = make_trainer(out, rewards=recording(REWARDS, seen))
    result = resumed.train(resume_from_checkpoint=True)
    assert result.global_step == resumed.state.global_step == 6 and seen == []
    for adapter, theirs in ((TRAIN_ADAPTER, reference_run.lora), (OLD_ADAPTER, reference_run.old_policy)):
        mine = _lora(resumed, adapter)
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs), adapter
    assert _logged(resumed.state.log_history, 6) == _logged(reference_run.log_history, 6)
    assert result.training_loss == pytest.approx(sum(reference_run.logged("loss")) / len(reference_run.logged("loss")))


def test_checkpoint_refuses_other_rewards_and_incomplete_folders(reference_run, tmp_path):
    other = make_trainer(tmp_path / "other", rewards=[REWARDS[0], redness])
    with pytest.raises(ValueError, match="trained with rewards"):
        load_training_state(other, reference_run.checkpoint(3))
    partial = tmp_path / "tmp-checkpoint-9" / "checkpoint-9"
    partial.mkdir(parents=True)
    with pytest.raises(ValueError, match="not a complete marble_trl checkpoint"):
        read_manifest(partial)
    # The reference checkpoint loads into a fresh trainer exactly.
    fresh = make_trainer(tmp_path / "fresh")
    load_training_state(fresh, reference_run.checkpoint(3))
    saved = load_file(str(reference_run.checkpoint(3) / LORA_FILE))
    for name, param in lora_parameters(fresh.transformer, TRAIN_ADAPTER).items():
        assert torch.equal(param, saved["transformer." + name.replace(".default.", ".")])


_KILL_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from marble_runs import make_trainer
import marble_trl.persistence.checkpoint as files
import marble_trl.trainer.checkpointing as ck

out, marker = sys.argv[1], sys.argv[2]
complete = ck.save_training_state

def slow(trainer, folder):
    if trainer.state.global_step == 3:  # write part of the state, then hang until killed
        ck.save_lora_file(trainer, folder, files.adapter_state(trainer.transformer, ck.OLD_ADAPTER), ck.OLD_POLICY_FILE)
        open(marker, "w").close()
        time.sleep(600)
    complete(trainer, folder)

ck.save_training_state = slow
make_trainer(out, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1).train()
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the training process exited early:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the training process never reached the save")
        time.sleep(0.2)


@pytest.mark.slow
def test_process_killed_during_save_leaves_last_checkpoint_loadable(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "saving"
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT.format(tests=str(TESTS)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), str(marker)], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for(marker, proc, timeout=300)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)

    # save_total_limit=1 removed checkpoint-1; the interrupted save of step 3 is only a staging folder; the killed
    # run's output_dir lock is left behind (stale: its pid is gone), and the resumed run takes it over.
    assert sorted(p.name for p in out.iterdir()) == [".marble_trl.lock", "checkpoint-2", "tmp-checkpoint-3"]
    assert json.loads((out / ".marble_trl.lock").read_text())["pid"] == proc.pid
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    with pytest.raises(ValueError, match="not a complete"):
        read_manifest(out / "tmp-checkpoint-3" / "checkpoint-3")
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2

    # The last good checkpoint resumes; the next save of step 3 replaces the stale staging folder.
    resumed = make_trainer(out, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]  # the lock is released at the end
    assert read_manifest(out / "checkpoint-3")["global_step"] == 3


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


_EXEC_WITH_SIGINT_IGNORED = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
)


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    """`marble-trl train` started as a background job (SIGINT ignored): SIGINT does nothing, SIGTERM stops the run
    after the current step with a checkpoint, and the process exits with status 0."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-u", "-m", "marble_trl.cli", "train", "--config", str(RECIPE), "--output_dir", str(out),
        "--max_steps", "500", "--disable_tqdm", "true", "--sample_grid_prompts", "0", "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--resolution", "16", "--num_sample_steps", "2",
    ]  # fmt: skip
    # Started the way `cmd &` starts a background job: SIGINT ignored (exec keeps an ignored signal ignored).
    cmd = [sys.executable, "-c", _EXEC_WITH_SIGINT_IGNORED, *cmd]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    output, deadline = [], time.monotonic() + 300
    while True:  # wait for the first logged step, then ask the run to stop
        line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
        assert line is not None, "".join(output[-50:])
        output.append(line)
        if " | loss " in line:  # the console's compact line of the first logged step
            break
    proc.send_signal(signal.SIGINT)  # ignored, as in any background job: it neither stops nor aborts the run
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0
    while (line := lines.get(timeout=30)) is not None:
        output.append(line)
    text = "".join(output)
    assert "stopped by SIGTERM" in text, text[-3000:]

    checkpoints = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    assert len(checkpoints) == 1 and not any(p.name.startswith("tmp-") for p in out.iterdir())
    step = read_manifest(checkpoints[0])["global_step"]
    assert 1 <= step < 500 and checkpoints[0].name == f"checkpoint-{step}"
    assert json.loads((checkpoints[0] / "trainer_state.json").read_text())["global_step"] == step
    assert json.loads((out / "run_summary.json").read_text())["global_step"] == step
    assert (out / LORA_FILE).is_file()


def test_replacing_an_existing_checkpoint_folder(tmp_path):
    """A stale checkpoint-N (an earlier run in the same output_dir) is replaced by the complete new one."""
    from marble_trl.persistence.checkpoint import replace_dir

    stale, new = tmp_path / "checkpoint-2", tmp_path / "tmp-checkpoint-2" / "checkpoint-2"
    stale.mkdir()
    (stale / "old.txt").write_text("old")
    new.mkdir(parents=True)
    (new / MANIFEST_FILE).write_text("{}")
    replace_dir(new, stale)
    assert sorted(p.name for p in stale.iterdir()) == [MANIFEST_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "tmp-checkpoint-2"]  # the empty staging root


def test_second_signal_aborts_without_saving(tmp_path):
    """Ctrl-C twice: the second SIGINT is re-delivered to the previous handler (KeyboardInterrupt), no checkpoint."""

    class TwoSigints(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.getsignal(signal.SIGINT)
    trainer = make_trainer(tmp_path / "run", max_steps=2, callbacks=[TwoSigints()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert signal.getsignal(signal.SIGINT) is previous
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


class _Trainer:
    """The little of a trainer that SaveOnSignalCallback touches outside training."""

    stopped_by_signal = None


def test_signal_handlers_respect_an_ignored_sigint():
    """Inherited SIG_IGN stays: the callback handles SIGTERM only, and restores both as they were."""
    from marble_trl.trainer.interruptions import SaveOnSignalCallback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the fixtures restore the handlers after the test
    callback = SaveOnSignalCallback(_Trainer())
    callback.install()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == callback.handle
    callback.restore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's default: both handled, both restored
    callback.install()
    assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == callback.handle
    callback.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_signal_handlers_leave_a_non_python_handler_alone(monkeypatch):
    """signal.getsignal() is None for a handler installed outside Python: it could not be restored, so it is kept."""
    from marble_trl.trainer.interruptions import SaveOnSignalCallback

    real = signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGINT else real(s))
    callback = SaveOnSignalCallback(_Trainer())
    callback.install()
    assert real(signal.SIGINT) is signal.default_int_handler and real(signal.SIGTERM) == callback.handle
    callback.restore()
    assert real(signal.SIGTERM) is signal.SIG_DFL


def test_ignored_sigint_neither_stops_nor_aborts_training(tmp_path):
    """A run started with SIGINT ignored (a background job) trains on through SIGINTs; SIGTERM still stops it
    with a checkpoint, and the ignored SIGINT is left ignored afterwards."""

    class Signals(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    trainer = make_trainer(tmp_path / "run", max_steps=3, callbacks=[Signals()])
    trainer.train()
    assert trainer.stopped_by_signal == "SIGTERM" and trainer.state.global_step == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-2"]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _torchrun(script: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_endpoint=127.0.0.1:0"]
    cmd += ["--rdzv_backend=c10d", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.heavy
@pytest.mark.slow
def test_two_process_stop_and_resume_keeps_the_data_position(reference_run, tmp_path):
    """2 processes: SIGTERM on rank 1 only stops both at step 3 with one checkpoint; the resumed run scores, step by
    step, the prompts of the 1-process reference run (accelerate's wrappers hide the sampler's epoch on a resume)."""
    worker = TESTS / "dist" / "resume_run.py"
    _torchrun(worker, str(tmp_path), "stop")
    stopped = [torch.load(tmp_path / f"stop-rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [s["global_step"] for s in stopped] == [3, 3] and stopped[0]["world"] == 2
    assert stopped[1]["stopped_by"] == "SIGTERM" and stopped[0]["stopped_by"] == "a signal on another process"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["checkpoint-3"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (tmp_path / "checkpoint-3").iterdir()}

    _torchrun(worker, str(tmp_path), "resume")
    resumed = [torch.load(tmp_path / f"resume-rank{r}.pt", weights_only=False) for r in (0, 1)]
    for step in range(6):
        run = stopped if step < 3 else resumed
        scored = sorted(run[0]["prompts"][step % 3] + run[1]["prompts"][step % 3])
        assert scored == sorted(reference_run.prompts[step]), f"step {step + 1} scored other prompts"
    for name, p0 in resumed[0]["lora"].items():
        assert torch.equal(p0, resumed[1]["lora"][name]), f"ranks disagree on {name}"
    assert resumed[0]["balancer"] == resumed[1]["balancer"] and resumed[0]["balancer"]["num_refreshes"] == 3
    assert resumed[0]["rewards"] == pytest.approx(reference_run.logged("rewards/brightness/mean"), abs=1e-4)


@pytest.mark.slow
def test_two_process_failure_on_one_rank_stops_every_rank_with_an_emergency_checkpoint(reference_run, tmp_path):
    """2 processes, a reward raising on rank 1 only in step 4: both ranks stop there together (rank 0 with
    PeerFailure instead of waiting in the reward gather until the launcher kills it) and write the emergency
    checkpoint of step 3, a complete one (the resume from such a checkpoint: the SIGTERM test above)."""
    from marble_trl.persistence.resume import validate_checkpoint

    worker = TESTS / "dist" / "resume_run.py"
    _torchrun(worker, str(tmp_path), "fail")
    failed = [torch.load(tmp_path / f"fail-rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [f["error"] for f in failed] == [("PeerFailure", True), ("RewardError", True)]
    assert [f["global_step"] for f in failed] == [3, 3]
    assert failed[0]["emergency_checkpoint"] == failed[1]["emergency_checkpoint"] == str(tmp_path / "checkpoint-3")
    validate_checkpoint(tmp_path / "checkpoint-3")  # every file present, finite and matching its SHA-256
    assert read_manifest(tmp_path / "checkpoint-3")["global_step"] == 3
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (tmp_path / "checkpoint-3").iterdir()}
    for name, p0 in failed[0]["lora"].items():
        assert torch.equal(p0, failed[1]["lora"][name]), f"ranks disagree on {name}"


def test_the_manifest_format_name_is_the_one_every_earlier_checkpoint_recorded(tmp_path):
    """`format` is a name written into every checkpoint's manifest, not a module path: a rename of the module that
    writes it (persistence/checkpoint.py) must not make earlier checkpoints unreadable."""
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": "marble_trl.checkpoint", "version": 1}))
    assert read_manifest(tmp_path)["format"] == "marble_trl.checkpoint"
