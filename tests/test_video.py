"""The reward contract for videos (marble_trl.rewards.video), video files, and a video family trained end to end."""

from __future__ import annotations

import asyncio
import builtins
import json

import pytest
import torch
from PIL import Image
from tiny import brightness, tiny_args

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.cli import main
from marble_trl.data.prompts import load_prompt_dataset
from marble_trl.evaluation.samples import save_samples, write_video
from marble_trl.rewards import resolve_reward_funcs, score_rewards
from marble_trl.rewards.video import VideoReward, fold_frames, still_frames, temporal_consistency

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")


def videos(b: int = 2, f: int = 3, side: int = 4) -> torch.Tensor:
    """Video ``i``'s frame ``t`` is the constant ``(10 i + t) / 100``."""
    values = torch.tensor([[(10 * i + t) / 100 for t in range(f)] for i in range(b)])
    return values[:, :, None, None, None].expand(b, f, 3, side, side).clone()


def test_image_reward_lifted_by_the_mean_over_frames():
    calls = {}

    def level(prompts, images, tag):
        calls.update(prompts=prompts, shape=tuple(images.shape), tag=tag)
        return images.mean(dim=(1, 2, 3)).tolist()

    out = VideoReward(level)(["a", "b"], videos(), tag=["x", "y"])
    assert calls == {"prompts": ["a", "a", "a", "b", "b", "b"], "shape": (6, 3, 4, 4), "tag": ["x"] * 3 + ["y"] * 3}
    assert out == pytest.approx([0.01, 0.11])
    assert VideoReward(level).__name__ == "level"


@pytest.mark.parametrize("frames, expected", [("first", [0.0, 0.1]), ("middle", [0.01, 0.11]), ("last", [0.02, 0.12]),
                                              ("-1", [0.02, 0.12]), (1, [0.01, 0.11])])  # fmt: skip
def test_image_reward_on_a_chosen_frame(frames, expected):
    seen = []

    def level(prompts, images):
        seen.append(images.shape[0])
        return images.mean(dim=(1, 2, 3)).tolist()

    assert VideoReward(level, frames)(["a", "b"], videos()) == pytest.approx(expected)
    assert seen == [2]


def test_frames_a_reward_does_not_score_are_left_out_of_the_mean():
    assert fold_frames([1.0, None, 3.0, None, None, None], 2, 3) == [2.0, None]
    assert fold_frames([1.0, float("nan"), 3.0, 1.0, 1.0, 1.0], 2, 3) == [2.0, 1.0]


def test_video_native_reward_gets_the_whole_video_and_the_names_are_kept():
    got = {}

    def native(prompts, videos, images):
        got.update(videos=tuple(videos.shape), images=tuple(images.shape))
        return [0.5] * len(prompts)

    scores = score_rewards([VideoReward(native)], ["a", "b"], videos(), names=["native"])
    assert got == {"videos": (2, 3, 3, 4, 4), "images": (2, 3, 4, 4)} and scores.tolist() == [[0.5, 0.5]]


def test_async_image_reward_is_lifted_too():
    async def level(prompts, images):
        await asyncio.sleep(0)
        return images.mean(dim=(1, 2, 3)).tolist()

    scores = score_rewards([VideoReward(level)], ["a", "b"], videos(), names=["level"])
    torch.testing.assert_close(scores, torch.tensor([[0.01, 0.11]]))


def test_wrong_count_from_a_lifted_reward_is_reported_with_its_name():
    def short(prompts, images):
        return [1.0]

    with pytest.raises(Exception, match="Reward 'short' returned 1 values for 2 samples"):
        score_rewards([VideoReward(short)], ["a", "b"], videos(), names=["short"])


def test_temporal_consistency_is_one_for_a_still_video_and_lower_when_it_flickers():
    still = torch.full((1, 4, 3, 4, 4), 0.3)
    flicker = still.clone()
    flicker[0, 1::2] = 0.7
    assert temporal_consistency(["a"], still) == [1.0]
    assert temporal_consistency(["a"], flicker) == pytest.approx([1 - 2 * 0.4])
    assert resolve_reward_funcs(["temporal_consistency"])[0] is temporal_consistency


def test_still_frames_of_videos_are_their_middle_frames():
    v = videos()
    torch.testing.assert_close(still_frames(v), v[:, 1])
    image = torch.rand(2, 3, 4, 4)
    assert still_frames(image) is image


def test_mp4_round_trip_and_gif_without_imageio(tmp_path, monkeypatch):
    import imageio.v3 as iio

    frames = torch.rand(5, 3, 16, 16) * 0 + torch.linspace(0, 1, 5)[:, None, None, None]
    path = write_video(frames, tmp_path / "clip")
    assert path.suffix == ".mp4"
    back = iio.imread(path, plugin="FFMPEG")
    assert back.shape == (5, 16, 16, 3)
    assert abs(back[..., 0].mean(axis=(1, 2)) / 255 - frames[:, 0].mean(dim=(1, 2)).numpy()).max() < 0.05

    real_import = builtins.__import__

    def no_imageio(name, *args, **kwargs):
        if name.startswith("imageio"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_imageio)
    gif = write_video(frames, tmp_path / "fallback")
    assert gif.suffix == ".gif" and Image.open(gif).n_frames == 5
    pairs = save_samples(torch.stack([frames, frames]), ["a", "b"], tmp_path / "card")
    assert [p for p, _ in pairs] == ["samples/000.gif", "samples/001.gif"]


def test_image_family_refuses_video_settings(tmp_path):
    def native(prompts, videos):
        return [0.0] * len(prompts)

    with pytest.raises(ValueError, match="num_frames=5 is for video families"):
        MarbleDiffusionNFTTrainer("tiny", [brightness], args=tiny_args(tmp_path, num_frames=5),
                                  train_dataset=load_prompt_dataset())  # fmt: skip
    with pytest.raises(ValueError, match="Reward 'native' takes videos, but sd3 makes images"):
        MarbleDiffusionNFTTrainer("tiny", [brightness, native], args=tiny_args(tmp_path),
                                  train_dataset=load_prompt_dataset())  # fmt: skip


def test_bad_video_reward_frames_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="video_reward_frames='all'"):
        tiny_args(tmp_path, video_reward_frames="all")


def test_wan_trains_on_a_lifted_and_a_native_reward_and_writes_video_samples(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model_name_or_path", "tiny-wan", "--reward_funcs", "brightness", "temporal_consistency"]
    argv += ["--max_steps", "2", "--output_dir", str(out), "--resolution", "16", "--num_frames", "5"]
    argv += ["--num_generations", "2", "--prompts_per_step", "2", "--per_device_train_batch_size", "4"]
    argv += ["--num_sample_steps", "2", "--max_sequence_length", "8", "--report_to", "none", "--use_cpu", "true"]
    argv += ["--sample_grid_prompts", "2", "--sample_grid_seeds", "1", "--eval_before_after", "false"]
    assert main(argv) == 0
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["global_step"] == 2
    assert Image.open(out / "samples_before_after.png").size[0] > 0
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/temporal_consistency/mean" in row for row in logs)

    assert sorted(p.name for p in (out / "rollouts").glob("*.mp4")) == []  # log_samples off by default
    videos_dir = tmp_path / "generated"
    argv = ["generate", "--model", "tiny-wan", "--lora", str(out), "--prompts", "a red apple", "--output"]
    assert main([*argv, str(videos_dir), "--seed", "1"]) == 0
    assert [p.name for p in videos_dir.glob("*.mp4")] == ["000-a-red-apple.mp4"]
    import imageio.v3 as iio

    assert iio.imread(videos_dir / "000-a-red-apple.mp4", plugin="FFMPEG").shape == (5, 16, 16, 3)  # marble_trl.json

    trainer = MarbleDiffusionNFTTrainer("tiny-wan", [brightness], args=tiny_args(tmp_path / "api", num_frames=9),
                                        train_dataset=load_prompt_dataset())  # fmt: skip
    assert trainer.generate(["a red apple"], seed=0).shape == (1, 9, 3, 16, 16)


def test_rollout_video_goes_to_wandb(tmp_path, monkeypatch):
    """A video family's rollout video reaches a real (offline) wandb run as a video file, next to the grid."""
    wandb = pytest.importorskip("wandb")
    from transformers.integrations import WandbCallback

    from marble_trl.trainer.trackers import log_image

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    callback = WandbCallback()
    run = wandb.init(project="marble-video-test", dir=str(tmp_path))
    try:
        video = write_video(torch.rand(5, 3, 16, 16), tmp_path / "clip")
        reached = log_image([callback], "train/samples", Image.new("RGB", (8, 8)), 1, caption="c", video=video)
    finally:
        run.finish()
    assert reached == ["wandb"]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    videos = list((run_dir / "files" / "media" / "videos").rglob("*.mp4"))
    assert videos and videos[0].stat().st_size > 0
