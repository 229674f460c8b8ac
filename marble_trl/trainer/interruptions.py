"""Interrupted training: SIGTERM / SIGINT finish the step and write a checkpoint (:class:`SaveOnSignalCallback`), a
crash writes an emergency checkpoint of the last completed step (:func:`save_emergency_checkpoint`), and
:func:`training_session` holds the ``output_dir`` lock and picks the checkpoint to resume from around
``trainer.train()``. The checkpoints themselves are :mod:`.checkpointing`'s.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..distributed import is_zero3, non_finite_tensors
from ..persistence.output_dir import OutputDirLock, check_not_overwriting
from ..persistence.resume import resolve_resume

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ SIGTERM / SIGINT
class SaveOnSignalCallback(TrainerCallback):
    """On SIGTERM or SIGINT, finish the current optimizer step, write a checkpoint and stop training cleanly.

    ``trainer.train()`` then returns normally and ``trainer.stopped_by_signal`` names the signal. A second signal
    restores the previous handlers and re-delivers itself (Ctrl-C twice aborts without saving). The checkpoint is
    written even with ``save_strategy="no"``. With several processes the flag is all-reduced at each step end, so
    all of them stop at the same step. Remove it with ``trainer.remove_callback(SaveOnSignalCallback)``.

    Handlers are installed by :func:`training_session` around ``trainer.train()`` (main thread only). A signal the
    process inherited as ignored stays ignored: a background job (``cmd &``) keeps ignoring SIGINT, SIGTERM still
    writes its checkpoint.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.received: int | None = None
        trainer.stopped_by_signal = None

    def handle(self, signum: int, frame) -> None:
        if self.received is not None:
            # Second signal: give up on the clean stop and let the previous handler act (default: terminate).
            self.restore()
            signal.raise_signal(signum)
            return
        self.received = signum
        logger.warning(
            "Received %s: a checkpoint will be written at the end of the current optimizer step, then training "
            "stops. Send it again to abort without saving.",
            signal.Signals(signum).name,
        )

    def install(self) -> None:
        """Handle the signals this process does not ignore.

        A signal inherited as ignored stays ignored (the Unix convention: a non-interactive shell starts background
        jobs, ``cmd &``, with SIGINT ignored, so that an interrupt meant for the foreground job does not reach them;
        ``nohup`` does the same with SIGHUP). A handler installed outside Python (``signal.getsignal`` returns
        ``None``) is left alone too: it could not be restored afterwards.
        """
        self.received = None
        self.trainer.stopped_by_signal = None
        self._previous = {}
        for s in self.SIGNALS:
            previous = signal.getsignal(s)
            if previous is signal.SIG_IGN or previous is None:
                name = signal.Signals(s).name
                how = "ignored" if previous is signal.SIG_IGN else "handled outside Python"
                logger.info("%s is %s in this process: left as it is (no checkpoint on %s).", name, how, name)
                continue
            self._previous[s] = signal.signal(s, self.handle)

    def restore(self) -> None:
        for s, handler in getattr(self, "_previous", {}).items():
            signal.signal(s, handler)
        self._previous = {}

    def _any_process_received(self) -> bool:
        flag = self.received is not None
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:
            t = torch.tensor([float(flag)], device=accelerator.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def on_step_end(self, args, state, control, **kwargs):
        if self._any_process_received():
            control.should_save = True
            control.should_training_stop = True
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another process"
            self.trainer.stopped_by_signal = name
            logger.warning("Stopping at step %d after %s; saving a checkpoint.", state.global_step, name)
        return control


@contextlib.contextmanager
def training_session(trainer: Trainer, resume_from_checkpoint=None) -> Iterator[str | None]:
    """Around ``trainer.train()``: refuse resumes this module cannot make exact, hold the ``output_dir`` lock, refuse to
    write over an earlier run, pick the checkpoint to resume from (yielded: the newest *valid* one for ``True``),
    install the :class:`SaveOnSignalCallback` handlers, and write an emergency checkpoint when training raises.
    Everything is undone on exit, also on errors."""
    args = trainer.args
    lock = OutputDirLock(args.output_dir, take_over=args.take_over_lock) if args.should_save else None
    if lock is not None:
        lock.acquire()
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, SaveOnSignalCallback)), None)
    active = callback is not None and threading.current_thread() is threading.main_thread()
    try:
        check_not_overwriting(args.output_dir, bool(resume_from_checkpoint), args.overwrite_output_dir)
        resume = resolve_resume(args.output_dir, resume_from_checkpoint)
        if active:
            callback.install()
        try:
            yield resume
        except Exception as error:
            save_emergency_checkpoint(trainer, error)
            raise
        finally:
            if active:
                callback.restore()
    finally:
        if lock is not None:
            lock.release()


def save_emergency_checkpoint(trainer: Trainer, error: BaseException) -> str | None:
    """After ``train()`` raised: write an atomic checkpoint of the last completed step (the state a step-end save
    would have written: a step interrupted midway changed no parameter), so the run resumes from there. Skipped
    before the first step, when that step's checkpoint exists, with non-finite weights (never saved), and with
    several processes unless every process failed at the same point (``error.all_processes``, set by
    :func:`~marble_trl.trainer.step.fail_together`: a save is collective, and otherwise the other processes may be
    stuck in a collective). Returns the folder or None."""
    step = trainer.state.global_step
    folder = Path(trainer.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    reason = None
    if step == 0:
        reason = "no optimizer step was completed"
    elif trainer.accelerator.num_processes > 1 and not getattr(error, "all_processes", False):
        reason = "a save needs every process, and with several processes the others may be stuck"
    elif getattr(trainer.nonfinite_guard, "stepped", False):
        # Saved under step N, the weights of step N + 1 (and a half-updated old policy) would resume wrongly.
        reason = f"the optimizer had already stepped in step {step + 1}, so the weights belong to no completed step"
    elif folder.is_dir():
        reason = f"{folder} already exists"
    else:
        partitions = False
        if trainer.full_policy is not None:  # full fine-tuning: the trained weights and their old-policy copy
            tensors, partitions = full_state_to_check(trainer)
        else:  # both adapters
            tensors = {n: p.detach() for n, p in trainer.transformer.named_parameters() if "lora_" in n}
            if trainer.param_ema is not None:
                tensors.update({f"ema.{n}": t for n, t in trainer.param_ema.state_dict().items()})
        if non_finite_tensors(tensors, all_processes=partitions):
            reason = "a trained weight, the old policy or the EMA is not finite"
    if reason is not None:
        logger.error(
            "Training failed at step %d (%s: %s); no emergency checkpoint: %s.",
            step,
            type(error).__name__,
            error,
            reason,
        )
        return None
    session = getattr(trainer, "session", None)
    if session is not None and not session.closed:  # the failed step's refresh moved alpha_bar: not a completed step's
        session.end(skipped=True)
        trainer.session = None
    try:
        trainer._save_checkpoint(trainer.model, trial=None)
    except Exception as save_error:  # the original error matters more: report both, raise the original
        logger.error("Training failed (%r) and the emergency checkpoint failed too: %r", error, save_error)
        return None
    logger.error(
        "Training failed at step %d (%s: %s). Emergency checkpoint: %s (resume with --resume_from_checkpoint true).",
        step,
        type(error).__name__,
        error,
        folder,
    )
    trainer.emergency_checkpoint = str(folder)
    return str(folder)


def full_state_to_check(trainer) -> tuple[dict[str, torch.Tensor], bool]:
    """A full fine-tune's trained weights, old policy and EMA as this process holds them, and whether they are ZeRO-3
    partitions (then the weights are DeepSpeed's float32 master partitions, every part without its padding, and the
    verdict is every process's)."""
    from ..policy.full import local_master
    from ..policy.full_shards import valid

    params = trainer.trainable_parameters()
    partitions = any(is_zero3(p) for p in params.values())
    if partitions:
        tensors = {n: valid(local_master(p), p) for n, p in params.items()}
    else:
        tensors = {n: p.detach() for n, p in params.items()}
    copies = {"old": trainer.full_policy.old}
    if trainer.param_ema is not None:
        copies["ema"] = trainer.param_ema.shadow
    for prefix, held in copies.items():
        tensors.update({f"{prefix}.{n}": valid(t, params[n]) if partitions else t for n, t in held.items()})
    return tensors, partitions
