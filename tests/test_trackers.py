"""``report_to`` with real trackers: a short MARBLE run (2 rewards, ``multi_objective_aggregation="auto"``) with
``log_samples`` and an evaluation, logged to TensorBoard, Trackio and (when installed) wandb in offline mode; each
test reads the tracker's own files back: the reward scalars, the MARBLE coefficients and the images.

The run is shared by the module (one training run, ~30 s on a busy CPU). The other tests check the pieces without
training: the diffusers config read as a transformers config by every integration, trackers found by type, the
captioned rollout grid, the option's validation.
"""

from __future__ import annotations

import glob
import inspect
import json
import re
import struct
import uuid
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from test_trainer import brightness, contrast, tiny_args
from transformers import TrainerCallback

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.trainer.trackers import TrackerConfig, adapt_model_config, log_image, rollout_grid, tracker_callbacks

TRAIN = Dataset.from_dict({"prompt": ["a red square", "a blue circle"]})
EVAL = Dataset.from_dict({"prompt": ["a cat"]})
REWARDS = ("brightness", "contrast")


def fast_args(output_dir, **overrides) -> MarbleDiffusionNFTConfig:
    kwargs = dict(
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=4,
        prompts_per_step=2,
        num_sample_steps=2,
        multi_objective_aggregation="auto",  # 2 rewards: MARBLE
        log_samples=1,
        eval_strategy="steps",
        eval_steps=1,
        eval_num_sample_steps=2,
    )
    kwargs.update(overrides)
    return tiny_args(output_dir, **kwargs)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One training step and one evaluation logged to TensorBoard, Trackio and (if installed) wandb offline."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("trackio")
    try:
        import wandb  # noqa: F401

        has_wandb = True
    except ImportError:
        has_wandb = False
    root = tmp_path_factory.mktemp("tracked-run")
    project = f"marble-trl-test-{uuid.uuid4().hex[:8]}"
    report_to = ["tensorboard", "trackio"] + (["wandb"] if has_wandb else [])
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            "WANDB_MODE": "offline",
            "WANDB_DIR": str(root),
            "WANDB_SILENT": "true",
            "WANDB_PROJECT": project,
            "TENSORBOARD_LOGGING_DIR": str(root / "tensorboard"),
        }.items():
            mp.setenv(name, value)
        args = fast_args(root / "out", report_to=report_to, run_name="tracked", project=project)
        trainer = MarbleDiffusionNFTTrainer(
            "tiny", [brightness, contrast], args=args, train_dataset=TRAIN, eval_dataset=EVAL
        )
        trainer.train()
        if has_wandb:
            import wandb

            wandb.finish()
    return {"root": root, "project": project, "trainer": trainer, "wandb": has_wandb}


def _train_log(trainer) -> dict:
    return next(h for h in trainer.state.log_history if "loss" in h)


def test_run_logged_rewards_marble_and_images(tracked_run):
    logs = _train_log(tracked_run["trainer"])
    for name in REWARDS:
        assert f"rewards/{name}/mean" in logs and f"marble/alpha_bar/{name}" in logs
    out = tracked_run["root"] / "out"
    assert (out / "rollouts" / "step-1.png").is_file() and (out / "eval" / "step-1.png").is_file()


def test_tensorboard_event_files(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(str(tracked_run["root"] / "tensorboard" / "events.out.tfevents.*"))
    acc = EventAccumulator(events, size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    logs = _train_log(tracked_run["trainer"])
    for name in REWARDS:
        for key in (f"train/rewards/{name}/mean", f"train/marble/alpha_bar/{name}"):
            assert key in scalars, sorted(scalars)
            ((event,),) = [acc.Scalars(key)]
            assert event.step == 1 and event.value == pytest.approx(logs[key[len("train/") :]], rel=1e-5)
    images = set(acc.Tags()["images"])
    assert {"train/samples", "eval/images"} <= images, images
    (sample,) = acc.Images("train/samples")
    assert sample.step == 1 and sample.width >= 128 and sample.height > 0
    # The text entries: the caption of the rollout grid, and the model config that used to crash on_train_begin.
    texts = set(acc.Tags()["tensors"])
    assert {"model_config/text_summary", "train/samples/caption/text_summary"} <= texts, texts
    config = acc.Tensors("model_config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config)["patch_size"] == 2
    caption = acc.Tensors("train/samples/caption/text_summary")[0].tensor_proto.string_val[0].decode()
    assert (
        "brightness=" in caption
        and "contrast=" in caption
        and ("a red square" in caption or "a blue circle" in caption)
    )


def test_trackio_local_store(tracked_run):
    from trackio.sqlite_storage import SQLiteStorage
    from trackio.utils import MEDIA_DIR

    project = tracked_run["project"]
    assert SQLiteStorage.get_runs(project) == ["tracked"]
    logs = SQLiteStorage.get_logs(project, "tracked")
    merged: dict = {}
    for row in logs:
        merged.update(row)
    expected = _train_log(tracked_run["trainer"])
    for name in REWARDS:
        assert merged[f"train/rewards/{name}/mean"] == pytest.approx(expected[f"rewards/{name}/mean"])
        assert merged[f"train/marble/alpha_bar/{name}"] == pytest.approx(expected[f"marble/alpha_bar/{name}"])
    for tag in ("train/samples", "eval/images"):
        image = merged[tag]
        assert image["_type"] == "trackio.image", image
        assert (MEDIA_DIR / image["file_path"]).is_file()
    assert "brightness=" in merged["train/samples"]["caption"]
    config = SQLiteStorage.get_run_config(project, "tracked")
    assert config["learning_rate"] == pytest.approx(1e-2) and config["patch_size"] == 2  # the model's config too


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` transaction log (LevelDB log format: 32 KiB blocks, 7-byte record
    headers ``crc32, length, type``; a 7-byte file header ``:W&B``, magic, version)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_files(tracked_run):
    if not tracked_run["wandb"]:
        pytest.skip("wandb is not installed (pip install 'marble-trl[wandb]')")
    (run_dir,) = glob.glob(str(tracked_run["root"] / "wandb" / "offline-run-*"))
    (log,) = glob.glob(f"{run_dir}/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(Path(log)):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:  # media are nested: ("train/samples", "path"), ...
                *outer, last = [item.key] if item.key else list(item.nested_key)
                target = history
                for key in outer:
                    target = target.setdefault(key, {})
                target[last] = json.loads(item.value_json)
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    expected = _train_log(tracked_run["trainer"])
    for name in REWARDS:
        assert history[f"train/rewards/{name}/mean"] == pytest.approx(expected[f"rewards/{name}/mean"])
        assert history[f"train/marble/alpha_bar/{name}"] == pytest.approx(expected[f"marble/alpha_bar/{name}"])
    for tag, folder in (("train/samples", "train"), ("eval/images", "eval")):
        assert history[tag]["_type"] == "image-file"
        assert (Path(run_dir) / "files" / history[tag]["path"]).is_file()
        assert glob.glob(f"{run_dir}/files/media/images/{folder}/*.png")
    assert "brightness=" in history["train/samples"]["caption"]
    assert config["patch_size"] == 2 and config["log_samples"] == 1


# ---------------------------------------------------------------------------------------------- no training
def test_model_config_reads_as_a_transformers_config(tiny_pipeline, tmp_path):
    """Every ``model.config.<method>`` call of transformers' integrations works on the trainer's model."""
    from diffusers.configuration_utils import FrozenDict
    from transformers.integrations import integration_utils

    source = inspect.getsource(integration_utils)
    called = set(re.findall(r"model\.config\.(\w+)\(", source))
    assert {"to_dict", "to_json_string"} <= called, called  # TensorBoard; Comet, MLflow, Neptune, ClearML
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness], args=tiny_args(tmp_path), train_dataset=TRAIN)
    config = trainer.model.config
    assert isinstance(config, TrackerConfig) and isinstance(config, FrozenDict) and isinstance(config, dict)
    assert called <= {name for name in dir(config) if callable(getattr(config, name))}, called
    as_dict = config.to_dict()
    assert type(as_dict) is dict and as_dict["patch_size"] == config.patch_size == 2
    assert json.loads(config.to_json_string()) == as_dict  # JSON types only
    assert isinstance(config.from_dict(as_dict), TrackerConfig)  # ClearML's remote override
    adapt_model_config(trainer.model)
    assert trainer.model.config is config  # idempotent
    assert tiny_pipeline.transformer.config.__class__ is FrozenDict  # another pipeline is untouched


def test_tensorboard_callback_starts_with_the_diffusers_model(tmp_path):
    """The crash of issue 14: ``TensorBoardCallback.on_train_begin`` called ``FrozenDict.to_json_string``."""
    pytest.importorskip("tensorboard")
    from transformers.integrations import TensorBoardCallback

    trainer = MarbleDiffusionNFTTrainer(
        "tiny", [brightness], args=tiny_args(tmp_path, report_to="tensorboard"), train_dataset=TRAIN
    )
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, TensorBoardCallback)]
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    try:
        assert tracker_callbacks(trainer.callback_handler.callbacks) == [("tensorboard", callback)]
    finally:
        callback.on_train_end(trainer.args, trainer.state, trainer.control)


class _Writer:
    def __init__(self):
        self.images, self.texts = [], []

    def add_image(self, tag, array, step, dataformats):
        self.images.append((tag, array.shape, step, dataformats))

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def flush(self):
        pass


def test_trackers_are_found_by_type_not_name():
    pytest.importorskip("tensorboard")
    from PIL import Image
    from transformers.integrations import TensorBoardCallback

    class MyTensorBoard(TensorBoardCallback):  # a user's subclass gets the images
        pass

    class TensorBoardCallbackLookalike(TrainerCallback):  # same attributes, not a tracker
        tb_writer = _Writer()

    mine, closed = MyTensorBoard(tb_writer=_Writer()), TensorBoardCallback()  # closed: no writer yet
    lookalike = TensorBoardCallbackLookalike()
    lookalike.__class__.__name__ = "TensorBoardCallback"
    image = Image.new("RGB", (20, 10))
    assert log_image([lookalike, closed, mine], "eval/images", image, 3, caption="hello") == ["tensorboard"]
    assert mine.tb_writer.images == [("eval/images", (10, 20, 3), 3, "HWC")]
    assert mine.tb_writer.texts == [("eval/images/caption", "hello", 3)]
    assert lookalike.tb_writer.images == []


def test_rollout_grid_captions():
    images = torch.rand(6, 3, 16, 16)
    prompts = ["a cat"] * 3 + ["a dog"] * 3
    rewards = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, float("nan")], [1, 2, 3, 4, 5, 6]], dtype=torch.float32)
    grid, caption = rollout_grid(images, prompts, rewards, ["aesthetic", "ocr"], groups=[0, 0, 1, 1, 2, 2])
    rows = caption.splitlines()
    assert len(rows) == 3  # by group, not by prompt: "a dog" is two groups
    assert rows[0] == "'a cat': aesthetic=0.1, ocr=1 | aesthetic=0.2, ocr=2"
    assert rows[2] == "'a dog': aesthetic=0.5, ocr=5 | aesthetic=n/a, ocr=6"
    assert grid.width >= 2 * 128 and "a cat" in " ".join(grid.info["captions"])
    _, few = rollout_grid(images, prompts, rewards, ["aesthetic", "ocr"], max_prompts=1, max_images=2)
    assert few == "'a cat': aesthetic=0.1, ocr=1 | aesthetic=0.2, ocr=2"


def test_log_samples_is_validated(tmp_path):
    with pytest.raises(ValueError, match="log_samples must be >= 0"):
        tiny_args(tmp_path, log_samples=-1)


def test_log_samples_every_n_steps(tmp_path):
    """``log_samples=2``: a grid at step 2, not at step 1 (here with report_to none: the PNG only)."""
    args = fast_args(tmp_path, max_steps=2, log_samples=2, eval_strategy="no")
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness], args=args, train_dataset=TRAIN)
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step-2.png"]
