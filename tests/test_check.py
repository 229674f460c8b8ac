"""``marble-trl check`` (docs/check.md): every shipped recipe passes on the hardware its header names and fails, with
the fix, on a 16 GB GPU; a broken config reports each of its errors; the memory arithmetic equals a hand computation
from the recorded measurements and docs/distributed.md's SD3.5 Medium table; the exit codes; docs/check.md's tables
are the check's output. In-process: the check's parse and model checks are offline and take seconds."""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from prompt_set_stub import install_synthetic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GIB = 1024**3
FAMILY_MEMORY = json.loads((ROOT / "benchmarks" / "results" / "family_memory.json").read_text())
DOC = ROOT / "docs" / "check.md"


def header_hardware(recipe: Path) -> tuple[list[str], int | None]:
    """What the recipe's header says it runs on: the launcher arguments of its first launch command and the smallest
    GPU memory it names (GiB), or ``None`` for a CPU recipe."""
    header = "\n".join(line for line in recipe.read_text().splitlines() if line.startswith("#"))
    if re.search(r"Hardware: any CPU", header):
        return [], None
    gpus = re.search(r"(\d+) GPUs? of (\d+)(?:-\d+)? GB", header) or re.search(r"one (\d+) GB GPU", header)
    assert gpus, f"{recipe.name}: the header names no GPU memory"
    memory = int(gpus.group(2) if gpus.lastindex == 2 else gpus.group(1))
    args = []
    config = re.search(r"--accelerate_config (recipes/accelerate/\S+\.yaml)", header)
    if config:
        args += ["--accelerate_config", str(ROOT / config.group(1))]
    processes = re.search(r"--num_processes (\d+)", header)
    if processes:
        args += ["--num_processes", processes.group(1)]
        if gpus.lastindex == 2:
            assert int(gpus.group(1)) == int(processes.group(1)), f"{recipe.name}: GPU count != --num_processes"
    return args, memory


def _user_files(recipe: Path, folder: Path) -> None:
    """The prompt files a recipe expects its user to provide (not the named prompt sets): written as the header says."""
    import yaml

    raw = yaml.safe_load(recipe.read_text())
    paths = [raw.get("dataset_name", "")] + [
        s.get("path", "") if isinstance(s, dict) else str(s).split("=")[0] for s in raw.get("dataset_mixture") or []
    ]
    from marble_trl.models import family_of

    editing = family_of(raw["model_name_or_path"]).editing
    for path in paths:
        if path.startswith("data/"):
            file = folder / path
            file.parent.mkdir(parents=True, exist_ok=True)
            rows = [
                {"prompt": p}
                for p in ("a cat walking on a beach at sunset", 'a neon sign that says "OPEN"', "a red car")
            ]
            if editing:  # an editing recipe's rows: each instruction with its image (relative to the file)
                from PIL import Image

                Image.new("RGB", (64, 64), "gray").save(file.parent / "source.png")
                rows = [{**row, "source_images": "source.png"} for row in rows]
            file.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A working folder with the papers' prompt sets cached (synthetic stand-ins: nothing downloaded) and the
    users' prompt files of the recipes, as a prepared machine has them."""
    folder = tmp_path_factory.mktemp("check")
    with pytest.MonkeyPatch.context() as mp:
        install_synthetic(mp, folder)
        for recipe in RECIPES:
            _user_files(recipe, folder)
        mp.chdir(folder)
        mp.setenv("HF_HUB_OFFLINE", "0")
        yield folder


@cache
def _run(recipe: str, *extra: str) -> tuple[int, str, object]:
    from marble_trl.commands.check import run_check

    report = run_check(["--config", str(ROOT / "recipes" / recipe), *extra])
    return report.exit_code, "\n".join(report.lines()), report


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_passes_on_its_header_hardware_and_fails_on_16gb(recipe: Path, workspace):
    launch, memory = header_hardware(recipe)
    gpu = ["--gpu_memory", f"{memory}GB"] if memory else []
    code, text, report = _run(recipe.name, *launch, *gpu)
    assert code == 0, text
    if memory is None:
        assert "the run is on the CPU" in text
        return
    assert re.search(r"\| \*\*needed\*\* \| \*\*[\d.]+\*\* \| (fits|tight) of", text), text
    assert "Rewards: prompts they score" in text  # the prompt sets were read: every reward scores some prompts
    code, text, report = _run(recipe.name, *launch, "--gpu_memory", "16GB")
    assert code == 1 and "does not fit" in text, text
    fixes = report.fixes()
    raw = recipe.read_text()
    if "activation_checkpointing: false" in raw:
        assert "add --activation_checkpointing true -> " in fixes[0], fixes  # the biggest saving comes first
    elif "offload_text_encoders: true" not in raw:
        assert any(f.startswith("add --offload_text_encoders true") for f in fixes), fixes
    elif "use_peft: false" not in raw:  # every saver on: the text encoders' visit alone outgrows 16 GB
        assert fixes[0].startswith("use GPUs with at least 18 GiB"), fixes
    else:  # full fine-tuning: the transformer's float32 copies outgrow 16 GB; a sharded launcher only with layer_gram
        assert int(re.search(r"use GPUs with at least (\d+) GiB", " ".join(fixes)).group(1)) > 16, fixes
        if "marble_gradient_engine: layer_gram" not in raw:
            assert not any("recipes/accelerate/" in f for f in fixes), fixes


def test_broken_config_reports_each_error(workspace):
    code, text, report = _run(
        "tiny-random.yaml",
        "--sample_scheduler", "DDIMScheduler",  # not a flow solver
        "--marble_rho", "1.5",  # out of range
        "--per_device_train_batch_size", "7",  # 16 images per step do not split into micro-batches of 7
        "--lora_target_modules", "attn.to_q", "attn.to_qq",  # no such layer in the transformer
        "--reward_funcs", "brightness", "no_such_reward",  # not registered
        "--resolution", "30",  # not a multiple of the tiny SD3's 4 pixels per token
    )  # fmt: skip
    assert code == 1
    messages = [f.message for f in report.errors]
    expected = ["sample_scheduler='DDIMScheduler'", "marble_rho must be in [0, 1)", "micro-batches of "
                "per_device_train_batch_size=7", "'attn.to_qq' matches no module", "Unknown reward 'no_such_reward'",
                "resolution=30 must be a multiple of 4"]  # fmt: skip
    for part in expected:
        assert sum(part in m for m in messages) == 1, (part, messages)
    assert len(report.errors) == len(expected), messages
    fixes = report.fixes()
    assert "set --sample_scheduler dpm2 (or euler, heun, ...: the names the error lists)" in fixes
    assert "lower per_device_train_batch_size to 4 (--per_device_train_batch_size 4)" in fixes
    assert "set --resolution 28" in fixes
    assert any("remove 'attn.to_qq' from lora_target_modules" in f for f in fixes)
    assert any("remove 'no_such_reward' from reward_funcs" in f for f in fixes)


def test_reward_checks(workspace, monkeypatch):
    """A reward applying to no prompt is an error; a missing extra names its pip install; weights not cached are
    named with what will be downloaded."""
    from marble_trl.commands.check import run_check

    monkeypatch.setitem(sys.modules, "rapidocr", None)  # as if the extra were not installed: its import fails
    (workspace / "plain.txt").write_text("a red apple\na blue boat\n")  # no quoted text: nothing for OCR to read
    report = run_check(["--config", str(ROOT / "recipes" / "tiny-random.yaml"), "--reward_funcs", "ocr", "brightness",
                        "clipscore", "--dataset_name", "plain.txt"])  # fmt: skip
    text = "\n".join(report.lines())
    assert report.exit_code == 1
    assert "reward 'ocr' applies to none of the 2 prompts" in text
    assert 'pip install "marble-trl[ocr]"' in report.fixes()
    assert "will download openai/clip-vit-large-patch14 on first use" in text


def test_memory_arithmetic_equals_a_hand_computation(workspace):
    """Z-Image's recipe on 8 GPUs (DDP), from benchmarks/results/family_memory.json's counts and activations."""
    recipe = ROOT / "recipes" / "z-image-marble-3rewards.yaml"
    code, text, _ = _run(recipe.name, *header_hardware(recipe)[0], "--gpu_memory", "48GB")
    z = FAMILY_MEMORY["Z-Image"]
    p, lora = z["params"], z["params"]["lora"]  # r = 32 on the default targets, as the recipe
    pickscore, clipscore = 986_109_441, 427_616_513  # CLIP ViT-H/14 and ViT-L/14 (memory_estimate.py's counts)
    hand = (
        2 * p["transformer"] + 2 * p["qwen3_4b"] + 2 * p["vae"]  # bf16 frozen weights
        + 4 * lora * 2  # trainable + old-policy adapters, fp32
        + 4 * lora * 3  # gradients + AdamW moments (DDP: not sharded)
        + 4 * lora  # DDP bucket
        + 4 * lora  # parameter EMA
        + 4 * lora * (3 + 1)  # MARBLE: K = 3 rewards + 1
        + 2 * (2 * pickscore + clipscore)  # pickscore, hpsv2, clipscore in bf16 on the GPU
        + 4 * z["activation_bytes_per_sample"]["checkpointing"]  # micro-batch 4, checkpointing, at the measured tokens
        + 1.5 * GIB  # CUDA context reserve
    )  # fmt: skip
    needed = float(re.search(r"\| \*\*needed\*\* \| \*\*([\d.]+)\*\*", text).group(1))
    assert needed == pytest.approx(hand / GIB, abs=0.005)


def test_static_memory_equals_the_recorded_benchmark():
    """The package's arithmetic reproduces benchmarks/results/family_memory.json's DDP column (the benchmark now
    computes it with the package)."""
    from marble_trl.preflight.memory import MemoryInputs, Strategy, estimate_memory

    for rec in FAMILY_MEMORY.values():
        p = rec["params"]
        text = sum(v for k, v in p.items() if k not in ("transformer", "lora", "vae"))
        inputs = MemoryInputs(
            transformer=p["transformer"], block=0, root=0, lora=p["lora"], text_encoders=text, vae=p["vae"],
            weight_bytes=2, strategy=Strategy("ddp", 8), micro_batch=0, act_plain=None, act_checkpointed=None,
            checkpointing=False, param_ema=False, marble_rows=6, moment_bytes=8, text_resident=True,
        )  # fmt: skip
        assert estimate_memory(inputs).phases["training"] == pytest.approx(rec["static_bytes"]["ddp"], rel=1e-12)


@pytest.mark.parametrize(
    ("recipe", "extra", "documented"),
    [
        ("sd35m-marble-5rewards.yaml", [], 38.3),  # docs/distributed.md: paper recipes, no checkpointing
        ("sd35m-marble-5rewards.yaml", ["--activation_checkpointing", "true"], 23.5),  # with checkpointing
        ("sd35m-marble-24gb.yaml", [], 15.6),  # peak while the text encoders visit (6 training, 7.0 scoring)
    ],
)
def test_sd35_medium_agrees_with_docs_distributed(recipe, extra, documented, workspace):
    launch = [] if "24gb" in recipe else ["--accelerate_config", str(ROOT / "recipes/accelerate/multi_gpu.yaml"),
                                          "--num_processes", "8"]  # fmt: skip
    _, text, _ = _run(recipe, *launch, *extra, "--gpu_memory", "80GB")
    peak = max(float(v) for v in re.findall(r"\| \*\*(?:training|scoring|encoding)\*\*[^|]*\| \*\*([\d.]+)\*\*", text))
    assert peak == pytest.approx(documented, abs=0.1)
    if "24gb" in recipe:
        assert re.search(r"\*\*training\*\* \| \*\*5\.9\d\*\*", text) and re.search(
            r"\*\*scoring\*\* \| \*\*7\.0", text
        )


def test_measure_is_skipped_without_a_gpu(workspace):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --measure runs for real")
    code, text, _ = _run("tiny-random.yaml", "--measure")
    assert code == 0 and "--measure skipped: no GPU on this machine" in text


def test_cli_exit_codes(workspace, capsys):
    """``marble-trl check`` returns 0 with the verdict, 1 with the fixes (the console script exits with ``main``'s
    return value; in-process: a subprocess would spend its time importing torch and transformers)."""
    from marble_trl.cli import main

    recipe = str(ROOT / "recipes" / "tiny-random.yaml")
    assert main(["check", "--config", recipe]) == 0
    assert "[marble-trl check] OK" in capsys.readouterr().out
    assert main(["check", "--config", recipe, "--num_generations", "1"]) == 1
    out = capsys.readouterr().out
    assert "num_generations must be >= 2" in out and "## Fixes" in out and "[marble-trl check] FAILED" in out
    assert main(["check", "--help"]) == 0 and "--gpu_memory" in capsys.readouterr().out


def test_benchmarks_build_the_package_architectures():
    """One home: the memory benchmarks take their models from marble_trl.preflight.architectures."""
    import importlib.util

    from marble_trl.preflight.architectures import architecture_named

    spec = importlib.util.spec_from_file_location("family_memory", ROOT / "benchmarks" / "family_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, entry in module.families().items():
        arch = architecture_named(name)
        assert (
            entry["build"] is arch.build
            and entry["tokens"]
            == json.loads((ROOT / "marble_trl" / "preflight" / "measured_memory.json").read_text())["architectures"][
                name
            ]["tokens"]
        )


# ------------------------------------------------------------------------------------------------ docs/check.md
def docs_block() -> str:
    """docs/check.md's generated part: the verdict of every recipe on its header's hardware and on 16 GB, then
    each GPU recipe's memory table."""
    rows = ["| recipe | launcher (header) | GPU | needed per GPU | verdict | on 16 GB: first fix |", "| --- | --- | --- | ---: | --- | --- |"]  # fmt: skip
    tables = []
    for recipe in RECIPES:
        launch, memory = header_hardware(recipe)
        if memory is None:
            rows.append(f"| `{recipe.name}` | CPU | - | - | passes (CPU run) | - |")
            continue
        _, text, report = _run(recipe.name, *launch, "--gpu_memory", f"{memory}GB")
        needed = re.search(r"\| \*\*needed\*\* \| \*\*([\d.]+)\*\* \| (\w+)", text)
        label = re.search(r"^- launcher: (.*) \(", text, re.M).group(1)
        _, _, small = _run(recipe.name, *launch, "--gpu_memory", "16GB")
        first = small.fixes()[0].split(" (")[0].split(" -> ")[0] if small.fixes() else "-"
        rows.append(
            f"| `{recipe.name}` | {label} | {memory} GB | {needed.group(1)} GiB | {needed.group(2)} | {first} |"
        )
        table = text.split(f"## Memory per GPU ({label})\n\n", 1)[1].split("\n\n", 1)[0]
        tables += [f"### `{recipe.name}`: {label}, {memory} GB GPUs", "", table, ""]
    return "\n".join(rows + [""] + tables).rstrip() + "\n"


def test_docs_tables_are_the_checks_output(workspace):
    text = DOC.read_text()
    start, end = "<!-- check-tables:start -->\n", "<!-- check-tables:end -->"
    current = text.split(start, 1)[1].split(end, 1)[0]
    assert current == docs_block(), "docs/check.md is stale: python tests/test_check.py > block, paste it"


if __name__ == "__main__":  # print docs/check.md's generated block (run from anywhere)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        install_synthetic(mp, Path(tmp))
        for recipe in RECIPES:
            _user_files(recipe, Path(tmp))
        mp.chdir(tmp)
        print(docs_block(), end="")


def _gib(text: str, item: str) -> float:
    return float(re.search(rf"\| {re.escape(item)} \| ([\d.]+) \|", text).group(1))


def test_full_finetuning_memory_counts_every_copy(workspace):
    """use_peft false on SD3.5 Medium, DDP x 8: the trained weights, their bf16 reference, the old policy, gradients
    and AdamW moments, the bucket, the EMA and MARBLE's K + 1 buffers, each a multiple of one fp32 copy; the fixes
    propose a sharded launcher only with layer_gram (as the trainer requires); under FSDP2 and ZeRO-3 every copy is
    an eighth; under ZeRO-2 the weights are bf16 (DeepSpeed casts the module) with partitioned fp32 masters."""
    ddp = ["--accelerate_config", str(ROOT / "recipes/accelerate/multi_gpu.yaml"), "--num_processes", "8"]
    _, text, report = _run("sd35m-marble-5rewards.yaml", *ddp, "--use_peft", "false", "--gpu_memory", "80GB")
    one = _gib(text, "trained weights (fp32)")
    assert "2,243.2 M params" in text and one == pytest.approx(2_243.2e6 * 4 / GIB, abs=0.01)
    assert _gib(text, "reference: the loaded trained weights (bf16)") == pytest.approx(one / 2, abs=0.01)
    assert _gib(text, "old policy (fp32 copy)") == one
    assert _gib(text, "trained weights: gradients + optimizer moments") == pytest.approx(3 * one, abs=0.01)
    assert _gib(text, "gradient bucket (DDP / DeepSpeed reduce)") == one
    assert _gib(text, "parameter EMA (fp32)") == one
    assert _gib(text, "MARBLE per-reward gradient buffers") == pytest.approx(6 * one, abs=0.02)
    assert "LoRA" not in text.split("## Memory per GPU", 1)[1].split("\n\n##", 1)[0]
    assert "does not fit" in text  # the paper procedure: no sharded launcher takes it (FSDP2 needs layer_gram)
    assert not any("recipes/accelerate/" in f for f in report.fixes())
    _, attention, _ = _run(
        "sd35m-marble-5rewards.yaml", *ddp, "--use_peft", "false", "--full_finetune_modules", "to_q", "to_k", "to_v",
        "to_out.0", "--gpu_memory", "80GB",
    )  # fmt: skip
    frozen, trained = _gib(attention, "frozen transformer weights (bf16)"), _gib(attention, "trained weights (fp32)")
    assert 0 < trained < one and frozen + trained / 2 == pytest.approx(one / 2, abs=0.02)
    # the released procedure with layer_gram: one slice instead of the K + 1 buffers, the solved pairs' forward twice
    released = ["--marble_procedure", "released", "--marble_gradient_engine", "layer_gram"]
    _, text, report = _run(
        "sd35m-marble-5rewards.yaml", *ddp, "--use_peft", "false", *released, "--gpu_memory", "80GB"
    )
    assert "MARBLE per-reward gradient buffers" not in text
    fixes = report.fixes()  # FSDP2 or ZeRO-3 shards full fine-tuning's copies
    assert any("recipes/accelerate/fsdp2.yaml" in f or "deepspeed_zero3.yaml" in f for f in fixes), fixes
    assert _gib(text, "MARBLE layer_gram: one slice of K rows") == pytest.approx(2**24 * 4 / GIB, abs=0.01)
    assert re.search(r"activations, micro-batch \d+ \([^)]*twice: layer_gram's solved pairs\)", text), text
    fsdp = ["--accelerate_config", str(ROOT / "recipes/accelerate/fsdp2.yaml"), "--num_processes", "8"]
    _, text, _ = _run("sd35m-marble-5rewards.yaml", *fsdp, "--use_peft", "false", "--gpu_memory", "80GB")
    assert "[full fine-tuning] use_peft false under FSDP2 takes its per-reward gradients from layer_gram" in text
    _, text, _ = _run("sd35m-marble-5rewards.yaml", *fsdp, "--use_peft", "false", *released, "--gpu_memory", "80GB")
    assert _gib(text, "old policy (fp32 copy), sharded") == pytest.approx(one / 8, abs=0.01)
    assert _gib(text, "parameter EMA (fp32), sharded") == pytest.approx(one / 8, abs=0.01)
    assert _gib(text, "trained weights: gradients + optimizer moments") == pytest.approx(3 * one / 8, abs=0.01)
    zero3 = ["--accelerate_config", str(ROOT / "recipes/accelerate/deepspeed_zero3.yaml"), "--num_processes", "8"]
    _, text, _ = _run("sd35m-marble-5rewards.yaml", *zero3, "--use_peft", "false", "--gpu_memory", "80GB")
    assert "[full fine-tuning] use_peft false under DeepSpeed ZeRO-3 takes its per-reward gradients from" in text
    _, text, _ = _run("sd35m-marble-5rewards.yaml", *zero3, "--use_peft", "false", *released, "--gpu_memory", "80GB")
    assert _gib(text, "trained weights' fp32 masters (DeepSpeed's optimizer), partitioned") == pytest.approx(
        one / 8, abs=0.01
    )
    assert _gib(text, "old policy (fp32 copy), partitioned") == pytest.approx(one / 8, abs=0.01)
    assert _gib(text, "parameter EMA (fp32), sharded") == pytest.approx(one / 8, abs=0.01)
    assert _gib(text, "the trained partitions set aside during a swap") == pytest.approx(one / 16, abs=0.01)
    offload = ["--accelerate_config", str(ROOT / "recipes/accelerate/deepspeed_zero3_offload.yaml")]
    _, text, _ = _run("sd35m-marble-5rewards.yaml", *offload, "--num_processes", "8", "--use_peft", "false", *released)
    assert "use_peft false under DeepSpeed ZeRO-3 does not support parameter offload" in text
    zero2 = ["--accelerate_config", str(ROOT / "recipes/accelerate/deepspeed_zero2.yaml"), "--num_processes", "8"]
    _, text, _ = _run("sd35m-marble-5rewards.yaml", *zero2, "--use_peft", "false", "--gpu_memory", "80GB")
    assert "[full fine-tuning]" not in text.replace("[full fine-tuning] 2,243.2 M trained", "")  # no refusal
    assert _gib(text, "transformer weights (bf16, DeepSpeed casts the module)") == pytest.approx(one / 2, abs=0.01)
    assert _gib(text, "old policy (fp32 copy)") == one and _gib(text, "parameter EMA (fp32)") == one
    assert _gib(text, "old policy rounded to bf16 for its forwards") == pytest.approx(one / 2, abs=0.01)
    assert _gib(text, "trained weights: gradients + optimizer moments") == pytest.approx(3 * one / 8, abs=0.01)
    assert _gib(text, "gradient bucket (DeepSpeed reduce)") == pytest.approx(5e8 * 2 / GIB, abs=0.01)
    assert _gib(text, "MARBLE per-reward gradient buffers") == pytest.approx(6 * one, abs=0.02)  # the paper's
