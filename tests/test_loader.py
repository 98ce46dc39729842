"""The checkpoint loader: every weight read as safetensors itself reads it, fused where the model
fuses, from one file or from shards, with each weight held once while it loads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdscope.checkpoint.make_model import make_model
from pdscope.engine.loader import CheckpointError, _read_into, _Stored, load_model

CPU = torch.device("cpu")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _as_safetensors_reads(path: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The model's tensor ``name`` from safetensors' own reading of the checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(file)
    module, _, leaf = name.rpartition(".")
    head, _, proj = module.rpartition(".")
    parts = [".".join(filter(None, (head, p, leaf))) for p in FUSED.get(proj, (proj,))]
    keys = [k if k.startswith("lm_head") else "model." + k for k in parts]
    return torch.cat([tensors[k] for k in keys]).to(dtype)


@pytest.mark.parametrize(
    ("arch", "stored", "dtype"),
    [
        ("llama", "bfloat16", torch.bfloat16),
        ("qwen2", "float32", torch.bfloat16),  # qkv biases; each part converted as it is read
        ("qwen3", "bfloat16", torch.float32),
    ],
)
def test_every_weight_is_what_safetensors_reads(
    tmp_path: Path, arch: str, stored: str, dtype: torch.dtype
) -> None:
    path = make_model(tmp_path / "m", "tiny", arch=arch, dtype=stored)
    model = load_model(path, dtype, CPU)
    names = [n for n, _ in model.named_parameters()]
    assert any("qkv_proj.bias" in n for n in names) == (arch == "qwen2")
    for name, param in model.named_parameters():
        assert param.dtype == dtype, name
        assert torch.equal(param, _as_safetensors_reads(path, name, dtype)), name


def test_a_sharded_checkpoint_loads_as_the_single_file(tmp_path: Path) -> None:
    """Hugging Face's layout past a few GB: shards named by model.safetensors.index.json, a
    fused projection's parts in different files."""
    one = make_model(tmp_path / "one", "tiny")
    tensors = load_file(one / "model.safetensors")
    names = sorted(tensors)
    shards = tmp_path / "shards"
    shards.mkdir()
    for f in one.iterdir():
        if f.suffix != ".safetensors":
            (shards / f.name).write_bytes(f.read_bytes())
    weight_map = {}
    first = [n for n in names if any(s in n for s in ("k_proj", "up_proj", "embed"))]
    for i, part_names in enumerate((first, [n for n in names if n not in first])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        part = {n: tensors[n] for n in part_names}  # a fused projection's parts apart
        save_file(part, shards / file)
        weight_map |= dict.fromkeys(part, file)
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert weight_map[q] != weight_map[k]
    a, b = load_model(one, torch.bfloat16, CPU), load_model(shards, torch.bfloat16, CPU)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def _rewrite(path: Path, change: dict[str, torch.Tensor]) -> None:
    tensors = load_file(path / "model.safetensors") | change
    save_file(tensors, path / "model.safetensors")


def test_a_fused_projection_whose_parts_do_not_join_is_named(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", "tiny")
    key = "model.layers.1.self_attn.k_proj.weight"
    k = load_file(path / "model.safetensors")[key]
    _rewrite(path, {key: k[:, :-1].contiguous()})
    with pytest.raises(CheckpointError, match=r"parts of 'layers\.1\.self_attn\.qkv_proj\.weight'"):
        load_model(path, torch.bfloat16, CPU)


def test_a_tensor_of_a_dtype_no_weight_comes_in_is_named_where_the_model_uses_it(
    tmp_path: Path,
) -> None:
    """An unused buffer of any dtype (a rotary table some checkpoints ship) is let be; a
    weight in one (here an integer norm) is refused by its name and dtype."""
    path = make_model(tmp_path / "m", "tiny")
    unused = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.arange(8, dtype=torch.int64)}
    _rewrite(path, unused)
    load_model(path, torch.bfloat16, CPU)
    key = "model.norm.weight"
    norm = load_file(path / "model.safetensors")[key]
    _rewrite(path, {key: torch.zeros(norm.shape, dtype=torch.int64)})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is I64"):
        load_model(path, torch.bfloat16, CPU)


def test_a_tensor_in_two_shards_is_named(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", "tiny")
    key = "model.norm.weight"
    save_file({key: load_file(path / "model.safetensors")[key]}, path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is in both"):
        load_model(path, torch.bfloat16, CPU)


def test_a_file_that_ends_inside_a_tensor_is_an_error_not_zeros(tmp_path: Path) -> None:
    """safe_open checks a file's length when the load begins; a file cut short after that
    (replaced while loading) is refused before its missing pages are mapped."""
    file = tmp_path / "w"
    file.write_bytes(bytes(range(10)))
    out = torch.empty(4, dtype=torch.bfloat16)
    with open(file, "rb") as fh:
        with pytest.raises(CheckpointError, match="ends inside a tensor"):
            _read_into(fh.fileno(), _Stored("w", file, "BF16", (4,), start=4), out)
        _read_into(fh.fileno(), _Stored("w", file, "BF16", (4,), start=2), out)
    assert out.view(torch.uint8).tolist() == list(range(2, 10))


PEAK = """
import resource, sys, torch
from pathlib import Path
from pdscope.engine.loader import load_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = load_model(Path(sys.argv[1]), torch.bfloat16, torch.device("cpu"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - max(before, 0)) * 1024)
"""


def test_the_load_holds_each_weight_once(tmp_path: Path) -> None:
    """The load's peak is the weights, not the weights beside the file: a mapping of the file
    (safe_open's) kept every page read resident until the last tensor over it was copied, and
    torch.cat copied a fused projection's parts once more (a 7B model's load peaked at the 23 GB
    of its host, 13.4 GB of copies beside 9.8 GB of the file). Measured in a process of its
    own, whose peak resident memory is the load's."""
    if sys.platform != "linux":
        pytest.skip("ru_maxrss is counted in KiB on Linux only")
    shape = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4}
    path = make_model(tmp_path / "m", "tiny", **shape)
    weights_bytes = (path / "model.safetensors").stat().st_size
    assert weights_bytes > 100 * 2**20
    run = subprocess.run(
        [sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, check=True
    )
    grown = int(run.stdout.split()[-1])
    assert grown < 1.6 * weights_bytes, (grown, weights_bytes)  # 2.27x before
