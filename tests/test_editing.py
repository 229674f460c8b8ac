"""Image editing: the source-image data contract, the two editing families against their diffusers pipelines, the
rewards' ``source_images=``, the editing rewards and ShapesBench's editing world.

The families' shared properties (the rollout equals an Euler loop on the trainer's velocity, per-reward gradients,
Prop. 1, the CLI, the LoRA reloaded in the family pipeline) run in tests/test_families.py like every family's.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from test_rewards_builtin import save_tiny_clip
from test_serve_reward import serving
from tiny import tiny_args

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.data.source_images import SourceImageLoader, check_source_images
from marble_trl.data.sources import load_source
from marble_trl.models import load_model
from marble_trl.models.editing import at_resolution
from marble_trl.models.flux import pack
from marble_trl.rewards import get_reward
from marble_trl.rewards.editing import preservation, ssim_map
from marble_trl.rewards.images import to_pil
from marble_trl.rollout.solvers import make_scheduler
from marble_trl.shapesbench import edits
from marble_trl.shapesbench.world import to_tensor

CPU = torch.device("cpu")
RESOLUTION = 16


def _png(seed: int, size: int = 40) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _pixels(data: bytes, side: int) -> torch.Tensor:
    image = Image.open(io.BytesIO(data)).convert("RGB").resize((side, side), Image.LANCZOS)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


# ------------------------------------------------------------------------------------------------------ data
def test_source_images_from_paths_bytes_pil_and_a_hub_image_column(tmp_path):
    """Every accepted form gives the same pixels (resized with Lanczos as the pipelines' image processor does);
    relative paths are relative to the data file; repeated images come from the cache."""
    from datasets import Dataset
    from datasets import Image as ImageFeature

    data = _png(0)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(data)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "make it red", "source_images": "img/a.png"}) + "\n")
    from_file = load_source(str(tmp_path / "rows.jsonl"))  # the path is made absolute against the file's folder
    check_source_images(from_file)
    loader = SourceImageLoader(32)
    expected = _pixels(data, 32)
    hub = Dataset.from_dict({"prompt": ["x"], "source_images": [{"bytes": data, "path": None}]})
    hub = hub.cast_column("source_images", ImageFeature())  # a Hub image column, decoded to PIL by datasets
    for value in (from_file[0]["source_images"], data, [data], Image.open(io.BytesIO(data)), hub[0]["source_images"]):
        torch.testing.assert_close(loader([value])[0], expected, rtol=0, atol=0)
    first = loader.pixels(data)
    assert loader.pixels(data) is first  # LRU cache
    check_source_images(hub)


def test_bad_source_images_name_the_row(tmp_path):
    from datasets import Dataset

    good = _png(1)
    (tmp_path / "good.png").write_bytes(good)
    cases = {  # (the good row, the bad row) of one column type
        "row 1's 'source_images' is not a readable image .FileNotFoundError: no image file": (str(tmp_path / "good.png"),
                                                                           str(tmp_path / "missing.png")),
        "row 1's 'source_images' is not a readable image .UnidentifiedImageError": (good, b"not an image"),
        "row 1 holds 2 source images": ([good], [good, good]),
    }  # fmt: skip
    for message, rows in cases.items():
        dataset = Dataset.from_dict({"prompt": ["a", "b"], "source_images": list(rows)})
        with pytest.raises(ValueError, match=message):
            check_source_images(dataset)
    with pytest.raises(ValueError, match="has no 'source_images' column"):
        check_source_images(Dataset.from_dict({"prompt": ["a"]}))


def test_the_trainer_refuses_a_mismatch_of_model_and_data(tmp_path):
    from datasets import Dataset

    args = tiny_args(tmp_path, max_steps=1)
    edit_rows = Dataset.from_dict({"prompt": ["make it red"] * 2, "source_images": [_png(2)] * 2})
    with pytest.raises(ValueError, match="'source_images' column, but StableDiffusion3Pipeline generates from text"):
        MarbleDiffusionNFTTrainer("tiny", ["brightness"], args=args, train_dataset=edit_rows)
    with pytest.raises(ValueError, match="has no 'source_images' column.*edits images"):
        MarbleDiffusionNFTTrainer(
            "tiny-flux-kontext", ["brightness"], args=args, train_dataset=Dataset.from_dict({"prompt": ["a"] * 2})
        )
    cached = tiny_args(tmp_path, max_steps=1, cache_prompt_embeddings=True)
    with pytest.raises(
        ValueError, match="cache_prompt_embeddings: QwenImageEditPipeline's prompt conditioning depends"
    ):
        MarbleDiffusionNFTTrainer("tiny-qwen-image-edit", ["brightness"], args=cached, train_dataset=edit_rows)


# ------------------------------------------------------------------------------------------------ the families
def test_kontext_samples_as_the_pipeline_edits_a_pil_image():
    """FluxKontextPipeline's own __call__ on the PIL sources (its preprocessing, VAE encode and packing) draws the
    adapter's rollout bit for bit, with the card's editing arguments; rows repeat two (prompt, image) pairs out of
    first-seen order, so the dedupe must map every row back to its own pair."""
    adapter = load_model("tiny-flux-kontext")
    adapter.pipeline.set_progress_bar_config(disable=True)
    side = adapter.source_resolution
    files = [_png(3, size=side), _png(4, size=side)]
    order = [1, 0, 1, 0]
    prompts = [["make it red", "move it left"][k] for k in order]
    sources = torch.stack([_pixels(files[k], side) for k in order])
    cond = adapter.encode(prompts, 16, CPU, 3.5, source_images=sources)
    scheduler = make_scheduler("euler", adapter.pipeline.scheduler)
    ours = adapter.sample(scheduler, cond, 3, RESOLUTION, torch.Generator().manual_seed(4), 3.5)
    theirs = adapter.pipeline(
        image=[Image.open(io.BytesIO(files[k])).convert("RGB") for k in order], prompt=prompts,
        num_inference_steps=3, guidance_scale=3.5, height=RESOLUTION, width=RESOLUTION, max_sequence_length=16,
        generator=torch.Generator().manual_seed(4), output_type="latent", **adapter.edit_call_kwargs(RESOLUTION),
    ).images  # fmt: skip
    torch.testing.assert_close(pack(ours), theirs, rtol=0, atol=0)
    other = adapter.encode(prompts, 16, CPU, 3.5, source_images=sources.flip(0))
    moved = adapter.sample(scheduler, other, 3, RESOLUTION, torch.Generator().manual_seed(4), 3.5)
    assert (moved - ours).abs().max() > 1e-3


def test_qwen_image_edit_prompts_see_their_image_and_rows_dedupe():
    """Each distinct (prompt, image) pair is encoded once, and every row (out of first-seen order) equals the
    pipeline's encode_prompt of its prompt with its image alone (the VL encoder's vision tokens) and the pipeline's
    VAE latents of its image; a different image changes the prompt's rows."""
    adapter = load_model("tiny-qwen-image-edit")
    side = adapter.source_resolution
    a, b = (torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(0)) * 255).round() / 255
    rows = [("make it blue", b), ("make it red", a), ("make it blue", b), ("make it red", b)]
    cond = adapter.encode([p for p, _ in rows], 64, CPU, source_images=torch.stack([im for _, im in rows]))
    pipe = adapter.pipeline
    for i, (prompt, image) in enumerate(rows):
        embeds, _ = pipe.encode_prompt(prompt=[prompt], image=to_pil(image[None]), device=CPU)
        row = cond.row(i)
        torch.testing.assert_close(row.prompt_embeds, embeds, rtol=1e-5, atol=1e-6)
        pixels = pipe.image_processor.preprocess(to_pil(image[None])[0], side, side).unsqueeze(2)
        latents = pipe._encode_vae_image(pixels, None)[:, :, 0]
        torch.testing.assert_close(row.image_latents, latents, rtol=1e-5, atol=1e-6)
    assert (cond.row(3).prompt_embeds - cond.row(1).prompt_embeds).abs().max() > 1e-4  # same prompt, other image


@pytest.mark.heavy
def test_qwen_image_edit_samples_as_the_pipeline_at_its_own_conditioning_size():
    """QwenImageEditPipeline.__call__ conditions on the source at about one megapixel whatever the output size; the
    adapter's own loop, conditioned the same way (source_resolution 1024), draws its latents bit for bit, true CFG
    included (about 30 s: the tiny VAE encodes a 1024 x 1024 source twice)."""
    adapter = load_model("tiny-qwen-image-edit")
    adapter.pipeline.set_progress_bar_config(disable=True)
    adapter.pipeline.source_resolution = 1024
    data = _png(5, size=1024)
    source = _pixels(data, 1024)[None]
    cond = adapter.encode(["make it red"], 64, CPU, 2.0, source_images=source)
    negative = adapter.encode([" "], 64, CPU, source_images=source)
    ours = adapter.sample(make_scheduler("euler", adapter.pipeline.scheduler), cond, 2, RESOLUTION,
                          torch.Generator().manual_seed(0), 2.0, negative)  # fmt: skip
    theirs = adapter.pipeline(
        image=Image.open(io.BytesIO(data)).convert("RGB"), prompt="make it red", negative_prompt=" ",
        true_cfg_scale=2.0, height=RESOLUTION, width=RESOLUTION, num_inference_steps=2, max_sequence_length=64,
        generator=torch.Generator().manual_seed(0), output_type="latent",
    ).images  # fmt: skip
    torch.testing.assert_close(pack(ours), theirs, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tiny-flux-kontext", "tiny-qwen-image-edit"])
def test_rewards_and_evaluation_receive_the_source_beside_each_edit(name, tmp_path):
    """Training and evaluation hand every reward each row's own source image, at the edits' size and on their device
    (instructions repeat across rows: rows are told apart by an id column)."""
    dataset = load_source("shapes_edit").select(range(8))
    dataset = dataset.add_column("row_id", list(range(len(dataset))))
    seen: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []

    def recorder(prompts, images, source_images, row_id, **_):
        seen.append((list(row_id), images.clone(), source_images.clone()))
        return [0.0] * len(prompts)

    args = tiny_args(tmp_path, max_steps=1, resolution=RESOLUTION, eval_strategy="no")
    trainer = MarbleDiffusionNFTTrainer(name, [recorder, "brightness"], args=args, train_dataset=dataset,
                                        eval_dataset=dataset.select(range(2)))  # fmt: skip
    trainer.train()
    trainer.evaluate()
    loader = SourceImageLoader(trainer.model_adapter.source_resolution)
    assert len(seen) == 2
    for ids, images, sources in seen:
        assert sources.shape == images.shape and sources.device == images.device
        expected = at_resolution(loader([dataset[i]["source_images"] for i in ids]), RESOLUTION)
        torch.testing.assert_close(sources, expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- rewards
def test_preservation_is_ssim_outside_the_edit_mask():
    g = torch.Generator().manual_seed(0)
    source = torch.rand(2, 3, 16, 16, generator=g)
    edited = source.clone()
    edited[:, :, :8, :8] = torch.rand(2, 3, 8, 8, generator=g)  # the top-left quadrant edited
    mask = np.zeros((16, 16), dtype=np.float32)
    mask[:11, :11] = 1  # the edit mask covers the edit and the 7 x 7 SSIM windows reaching into it
    assert preservation(["a", "b"], source, source_images=source) == pytest.approx([1.0, 1.0])
    unmasked = preservation(["a", "b"], edited, source_images=source)
    masked = preservation(["a", "b"], edited, source_images=source, edit_masks=[mask, mask.tolist()])
    assert max(unmasked) < 0.9 and masked == pytest.approx([1.0, 1.0], abs=1e-5)
    assert ssim_map(source, 1 - source).mean() < 0.2
    with pytest.raises(ValueError, match="'preservation' scores edits against their source images"):
        preservation(["a"], source[:1])


def test_clip_directional_scores_the_image_change_against_the_text_change(tmp_path):
    path = save_tiny_clip(tmp_path / "clip")
    reward = get_reward("clip_directional", model_name_or_path=str(path), batch_size=2)
    g = torch.Generator().manual_seed(1)
    source, edit = torch.rand(3, 3, 32, 32, generator=g), torch.rand(3, 3, 32, 32, generator=g)
    prompts = ["make the cat red", "add a hat", "remove the dog"]
    scores = reward(prompts, edit, source_images=source)
    reward.load()
    with torch.no_grad():
        change = torch.nn.functional.normalize(reward._image(edit) - reward._image(source), dim=-1)
        expected = (change * reward._text(prompts)).sum(-1)
    assert scores == pytest.approx(expected.tolist(), abs=1e-5) and all(-1 <= s <= 1 for s in scores)
    captions = {"source_captions": ["a cat"] * 3, "target_captions": ["a red cat", "a cat in a hat", "a cat"]}
    with_captions = reward(prompts, edit, source_images=source, **captions)
    assert with_captions != pytest.approx(scores)
    one_by_one = [reward([p], edit[i : i + 1], source_images=source[i : i + 1])[0] for i, p in enumerate(prompts)]
    assert one_by_one == pytest.approx(scores, abs=1e-5)
    with pytest.raises(ValueError, match="give both source_captions and target_captions"):
        reward(prompts, edit, source_images=source, source_captions=["a"] * 3)


def test_http_reward_sends_the_source_images_to_the_judge():
    """A VLM judge behind http_reward receives the sources as images (lossless PNG), as the reward would in process."""

    def difference(prompts, images, source_images=None, **_):
        return (images - source_images).abs().mean(dim=(1, 2, 3)).tolist()

    g = torch.Generator().manual_seed(2)
    images = (torch.rand(3, 3, 16, 16, generator=g) * 255).round() / 255
    sources = (torch.rand(3, 3, 16, 16, generator=g) * 255).round() / 255
    with serving(difference) as server:
        client = get_reward("http_reward", url=server.url, retries=0, batch_size=2)
        remote = client(["a", "b", "c"], images, source_images=sources, tag=["x", "y", "z"])
    assert remote == pytest.approx(difference(None, images, sources), abs=1e-6)


# ------------------------------------------------------------------------------------------ ShapesBench edits
def test_shapes_edit_scorers_reward_the_edit_and_the_untouched_rest():
    examples = edits.sample_edits(32, seed=7)
    source = to_tensor(np.stack([edits.draw(e.source) for e in examples]))
    target = to_tensor(np.stack([edits.draw(e.target) for e in examples]))
    rows = [e.row() for e in examples]
    columns = {k: [r[k] for r in rows] for k in edits.EDIT_COLUMNS}
    prompts = [e.prompt for e in examples]
    assert {e.kind for e in examples} == set(edits.KINDS)
    done = edits.instruction(prompts, target, **columns)
    assert min(done) > 0.9 and max(edits.instruction(prompts, source, **columns)) < 0.05
    assert min(edits.preservation(prompts, target, source_images=source, **columns)) == pytest.approx(1.0)
    noise = torch.rand_like(source, generator=torch.Generator().manual_seed(0))
    assert max(edits.preservation(prompts, noise, source_images=source, **columns)) < 0.01
    # object by object: the kept shape removed or recoloured zeroes its quadrant, the untouched empty ones score 1
    kept = [len(edits.QUADRANTS) - len(e.edit_quadrants) for e in examples]
    expected = [(k - 1) / k for k in kept]
    for damage in (lambda e, s: None, lambda e, s: s.recolored(next(c for c in edits.COLORS if c != s.color))):
        damaged = [tuple(x for x in e.target if x != e.source[1]) + tuple(filter(None, [damage(e, e.source[1])]))
                   for e in examples]  # fmt: skip
        images = to_tensor(np.stack([edits.draw(d) for d in damaged]))
        assert edits.preservation(prompts, images, source_images=source, **columns) == pytest.approx(expected)
    # graded: 10 stray pixels in an empty kept quadrant cost half of it (20 px tolerated), a whole object all of it
    free = [next(q for q in edits.QUADRANTS if q not in e.edit_quadrants and q not in {x.quadrant for x in e.source})
            for e in examples]  # fmt: skip
    specks = target.clone()
    for i, q in enumerate(free):
        qx, qy = edits.QUADRANTS[q]
        specks[i, :, qy * 16 + 8, qx * 16 + 3 : qx * 16 + 13] = torch.tensor([1.0, 0.0, 0.0])[:, None]
    assert edits.preservation(prompts, specks, source_images=source, **columns) == pytest.approx(
        [1 - 0.5 / k for k in kept]
    )
    intruder = [e.target + (edits.Shape("square", "red", q, 5.0, 0.0, 0.0),) for e, q in zip(examples, free)]
    images = to_tensor(np.stack([edits.draw(d) for d in intruder]))
    assert edits.preservation(prompts, images, source_images=source, **columns) == pytest.approx(expected)
    with pytest.raises(ValueError, match="row 0's edit_quadrants 'top left' name unknown quadrants"):
        edits.preservation(prompts[:1], images[:1], source_images=source[:1], edit_quadrants=["top left"])
    # the loaded rows' PNG sources are the drawn scenes
    dataset = edits.edit_dataset(8, seed=7)
    loaded = SourceImageLoader(32)(dataset["source_images"])
    torch.testing.assert_close(loaded, source[:8], rtol=0, atol=0)
    assert math.isclose(len(edits.edit_dataset()), edits.TRAIN_ROWS)


def test_shapes_edit_model_and_benchmark_run_as_documented(tmp_path):
    """The shipped ``shapes-edit`` model loads by name as a FLUX.1 Kontext conditioned on 32 px sources, and one
    benchmark run (a step of MARBLE on the three rewards) writes the record the report reads."""
    from marble_trl.models import family_of
    from marble_trl.models.flux_kontext import FluxKontextAdapter
    from marble_trl.models.tiny import shapes_edit_model_path
    from marble_trl.shapesbench.edit_bench import EditBudget, report, run_one
    from marble_trl.shapesbench.edit_pretrain import EditPretrainConfig

    assert family_of("shapes-edit") is FluxKontextAdapter
    adapter = load_model("shapes-edit")
    assert adapter.source_resolution == 32 and adapter.pipeline.name_or_path == "shapes-edit"
    info = json.loads((shapes_edit_model_path() / "shapesbench.json").read_text())
    assert info["key"] == EditPretrainConfig().key()  # the shipped model is the default pretraining's
    budget = EditBudget(steps=1, prompts_per_step=2, num_generations=2, eval_images_per_row=1)
    record = run_one("marble", 0, budget, tmp_path)
    assert set(record["base"]) == set(record["after"]) == {"instruction", "preservation", "fidelity"}
    assert json.loads((tmp_path / "marble-seed0.json").read_text()) == json.loads(json.dumps(record))
    table = report(tmp_path)
    assert "| base (shapes-edit) |" in table and "| marble | 0 |" in table


def test_marble_trl_evaluate_edits_each_rows_source(tmp_path):
    """``marble-trl evaluate`` on an editing model edits every prompt's own source image and hands it to the
    rewards: its edits preserve their own sources far better than another row's (a mixed-up run's score)."""
    from marble_trl.cli import main

    out = tmp_path / "eval"
    argv = ["evaluate", "--model", "shapes-edit", "--prompts", "shapes_edit_eval", "--max_prompts", "8"]
    argv += ["--reward_funcs", "shapes_edit_instruction", "shapes_edit_preservation", "--num_sample_steps", "6"]
    argv += ["--resolution", "32", "--max_sequence_length", "40", "--output", str(out), "--grid_prompts", "8"]
    argv += ["--no_progress", "--device", "cpu"]
    assert main(argv) == 0
    scores = [json.loads(line) for line in (out / "base" / "scores.jsonl").read_text().splitlines()]
    assert len(scores) == 8
    ours = [row["scores"]["shapes_edit_preservation"] for row in sorted(scores, key=lambda r: r["prompt_index"])]
    rows = load_source("shapes_edit_eval").select(range(8))
    files = sorted((out / "base" / "images").glob("*.png"))
    edited = torch.stack([torch.from_numpy(np.asarray(Image.open(f).convert("RGB")).copy()) for f in files])
    edited = edited.permute(0, 3, 1, 2).float() / 255
    sources = SourceImageLoader(32)(rows["source_images"])
    own = edits.preservation(rows["prompt"], edited, source_images=sources, edit_quadrants=rows["edit_quadrants"])
    assert ours == pytest.approx(own, abs=1e-6)  # the saved PNGs are the scored edits, scored against their rows
    mixed = edits.preservation(rows["prompt"], edited, source_images=sources.roll(1, dims=0),
                               edit_quadrants=rows["edit_quadrants"])  # fmt: skip
    assert sum(ours) / 8 > sum(mixed) / 8 + 0.3, (ours, mixed)


def test_source_image_details_exif_cache_and_single_values(tmp_path):
    """A phone photo's EXIF orientation is applied (as diffusers' load_image does); the cache is bounded in bytes;
    one value (a path, a PIL image, a [3, H, W] tensor) is one image, a [B, 3, H, W] tensor B images."""
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:, :20] = 255  # left half white: rotated by the EXIF tag, it becomes the top or the bottom half
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    path = tmp_path / "phone.jpg"
    image.save(path, exif=exif, quality=100)
    upright = SourceImageLoader(40)(str(path))[0]
    assert upright[:, :20].mean() > 0.9 and upright[:, 20:].mean() < 0.1  # the white half on top
    loader = SourceImageLoader(8, cache_bytes=3 * 8 * 8 * 2)  # room for two images
    for seed in range(3):
        loader.pixels(_png(seed))
    assert len(loader._cache) == 2 and loader._bytes == 2 * 3 * 8 * 8
    tensor = torch.rand(3, 8, 8)
    assert loader(tensor).shape == (1, 3, 8, 8) and loader(torch.stack([tensor] * 3)).shape == (3, 3, 8, 8)
    assert loader(Image.open(io.BytesIO(_png(0)))).shape == (1, 3, 8, 8)


def test_sources_are_guarded_like_images_and_http_needs_a_tensor():
    from marble_trl.rewards import RewardError, score_rewards
    from marble_trl.rewards.http import HTTPReward

    def vandal(prompts, images, source_images, **_):
        source_images.mul_(0)
        return [0.0] * len(prompts)

    images, sources = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8)
    with pytest.raises(RewardError, match="'vandal' modified the images it was given in place"):
        score_rewards([vandal], ["a", "b"], images, {"source_images": sources})
    with pytest.raises(Exception, match="source_images must be a \\[B, 3, H, W\\] tensor"):
        HTTPReward("http://127.0.0.1:9", retries=0)(["a"], images[:1], source_images=["a.png"])


def test_resume_fingerprint_and_probe_follow_the_source_images():
    """Changing a row's source image changes the dataset fingerprint (a resume would refuse it); the DDP probe of an
    editing model edits small sources, not the model's 1024 px ones."""
    from datasets import Dataset

    from marble_trl.persistence.resume import dataset_fingerprint
    from marble_trl.trainer.setup import unreached_trainable

    rows = {"prompt": ["make it red", "make it red"], "source_images": [_png(0), _png(1)]}
    swapped = {**rows, "source_images": [_png(1), _png(0)]}
    assert dataset_fingerprint(Dataset.from_dict(rows)) != dataset_fingerprint(Dataset.from_dict(swapped))
    adapter = load_model("tiny-flux-kontext")
    adapter.pipeline.source_resolution = 1024
    seen = []
    encode_images = adapter.encode_images
    adapter.encode_images = lambda images, device: seen.append(images.shape[-1]) or encode_images(images, device)
    params = {n: p for n, p in adapter.transformer.named_parameters() if n.endswith("proj_out.weight")}
    assert unreached_trainable(adapter, adapter.transformer, params) == []
    assert seen == [adapter.latent_factor * 2] and adapter.pipeline.source_resolution == 1024
