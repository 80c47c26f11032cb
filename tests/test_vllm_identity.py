"""The model identity of ``kvproto.vllm.identity``: the weights fingerprint tells apart
two checkpoints of one shape (two paths, or one replaced in place), matches copies, reads
a bounded number of bytes; ``model_identity`` reads a real vLLM 0.32 ``VllmConfig``; a
pinned revision replaces the fingerprint. No engine is started."""

from __future__ import annotations

import os
import shutil
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvproto.vllm import identity as ident
from kvproto.vllm.harness import build_tiny_model
from kvproto.vllm.sched import ConnectorOptions

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("ident")
    a = build_tiny_model(d / "a", seed=0).path
    b = build_tiny_model(d / "b", seed=1).path
    # One configuration file for both (the builder records the seed in it): the two
    # checkpoints then differ in their weights only.
    shutil.copy(a / "config.json", b / "config.json")
    return a, b


def test_fingerprint_tells_weights_apart_and_matches_copies(models: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    a, b = models
    fa, _ = ident.weights_fingerprint(a)
    fb, _ = ident.weights_fingerprint(b)
    assert fa.startswith("sha256:") and len(fa) == 7 + ident.FINGERPRINT_HEX
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert fa != fb  # same architecture and shape, other weights
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(a, copy)
    (copy / ".cache").mkdir()  # local bookkeeping is not the model
    (copy / ".cache" / "download.lock").write_text("x")
    os.utime(copy / "model.safetensors", (1, 1))
    assert ident.weights_fingerprint(copy)[0] == fa  # the path and times do not count


def test_fingerprint_changes_when_replaced_in_place(models: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    a, b = models
    live = tmp_path / "live"
    shutil.copytree(a, live)
    before = ident.weights_fingerprint(live)[0]
    shutil.copy(b / "model.safetensors", live / "model.safetensors")  # a rolling update
    after = ident.weights_fingerprint(live)[0]
    assert before != after == ident.weights_fingerprint(b)[0]


def test_large_files_are_sampled_with_a_bounded_read(tmp_path: Path) -> None:
    size = 64 * ident.SAMPLE_STRIDE + 12345
    f = tmp_path / "big.safetensors"
    with open(f, "wb") as fh:  # sparse: costs no disk
        fh.truncate(size)
    (tmp_path / "config.json").write_text("{}")
    fp, nread = ident.weights_fingerprint(tmp_path)
    offsets = ident._offsets(size)
    assert offsets[0] == 0 and offsets[-1] == size - ident.SAMPLE_BYTES
    assert max(b - a for a, b in pairwise(offsets)) <= ident.SAMPLE_STRIDE
    assert nread == len(offsets) * ident.SAMPLE_BYTES + 2
    assert nread < size // 1000
    with open(f, "r+b") as fh:  # a change at a sampled place is seen ...
        fh.seek(offsets[len(offsets) // 2] + 10)
        fh.write(b"\x01")
    assert ident.weights_fingerprint(tmp_path)[0] != fp
    assert len(ident._offsets(1 << 50)) == ident.MAX_SAMPLES  # ... and the count is capped


def test_fingerprint_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ident.FingerprintError, match="neither"):
        ident.weights_fingerprint(tmp_path / "missing")
    with pytest.raises(ident.FingerprintError, match="no file"):
        ident.weights_fingerprint(tmp_path)
    with pytest.raises(ident.FingerprintError, match="model_revision"):
        ident.weights_identity(str(tmp_path / "not-here"), revision=None)
    assert ident.weights_identity("anything", pinned="v7") == "revision:v7"
    assert ident.weights_identity("anything", load_format="dummy") == "dummy"


def test_model_revision_option() -> None:
    assert ConnectorOptions.parse({"model_revision": "2026-11-rc1"}).model_revision == \
        "2026-11-rc1"
    assert ConnectorOptions.parse({}).model_revision is None
    for bad in ("", 7, "x" * 1000):
        with pytest.raises(ValueError, match="model_revision"):
            ConnectorOptions.parse({"model_revision": bad})


def test_kv_layout_leaves_out_the_block_count() -> None:
    t8 = [torch.zeros((8, 2, 4, 16), dtype=torch.float16) for _ in range(3)]
    t9 = [torch.zeros((9, 2, 4, 16), dtype=torch.float16) for _ in range(3)]
    assert ident.kv_layout(t8, 8) == ident.kv_layout(t9, 9) == "3x(N,2,4,16)[0123]float16"
    assert ident.kv_layout([torch.zeros((8, 2, 4, 16))], 8) != ident.kv_layout(t8[:1], 8)
    perm = [torch.zeros((2, 8, 4, 16), dtype=torch.float16)]
    assert ident.kv_layout(perm, 8) != ident.kv_layout(t8[:1], 8)


def test_kv_layout_per_head_is_the_same_at_every_tp_size() -> None:
    """vLLM's CPU layout (N, heads, block size, 2 x head size): TP 1 with 2 heads and
    TP 2 with 1 head per rank describe one head's slice alike."""
    tp1 = [torch.zeros((8, 2, 32, 64), dtype=torch.float16)]
    tp2 = [torch.zeros((8, 1, 32, 64), dtype=torch.float16)]
    assert ident.kv_layout(tp1, 8, heads=2) == ident.kv_layout(tp2, 8, heads=1) \
        == "1x(N,H,32,64)[0123]float16"
    assert ident.kv_layout(tp1, 8) != ident.kv_layout(tp2, 8)
    other = [torch.zeros((8, 1, 32, 128), dtype=torch.float16)]  # another head size
    assert ident.kv_layout(other, 8, heads=1) != ident.kv_layout(tp2, 8, heads=1)


def test_heterogeneous_tp_pairs_by_rule_not_by_block_bytes() -> None:
    from kvproto.wire import Handshake, Layout, WireError, check_peer

    idt = {"num_kv_heads": "2", "kv_layout": "1x(N,H,32,64)[0123]float16", "weights": "w"}
    p_lay = Layout(100, 8192, "float16", 0, 1)  # P TP 1: two heads per block
    d_lay = Layout(50, 4096, "float16", 1, 2)  # D TP 2: one head per block
    hs = Handshake("p", 1, p_lay, b"", "producer", identity=dict(idt))
    check_peer(hs, "producer", d_lay, dict(idt))  # pairs
    with pytest.raises(WireError, match="model_mismatch"):  # other weights: refused
        check_peer(hs, "producer", d_lay, {**idt, "weights": "v"})
    with pytest.raises(WireError, match="cannot hold"):  # 3 ranks cannot split 2 heads
        check_peer(hs, "producer", Layout(50, 4096, "float16", 1, 3), dict(idt))
    with pytest.raises(WireError, match="layout_mismatch"):  # same TP: bytes must match
        check_peer(hs, "producer", Layout(50, 4096, "float16", 0, 1), dict(idt))
    with pytest.raises(WireError, match="layout_mismatch"):  # no identity: bytes rule
        check_peer(Handshake("p", 1, p_lay, b"", "producer"), "producer", d_lay, None)


def test_model_identity_of_a_real_vllm_config(models: tuple[Path, Path]) -> None:
    """From vLLM's own VllmConfig (built, not run): every field is there; two checkpoints
    of one shape differ in ``weights`` only; a pin replaces the fingerprint."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    a, b = models

    def config(path: Path) -> object:
        return EngineArgs(model=str(path), skip_tokenizer_init=True, enforce_eager=True,
                          block_size=32, kv_cache_memory_bytes=64 << 20).create_engine_config()

    ca, cb = config(a), config(b)
    tensors = [torch.zeros((16, 2, 4, 32, 32), dtype=torch.bfloat16) for _ in range(2)]
    groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=SimpleNamespace(block_size=32), layer_names=["l0", "l1"])])
    ia = ident.model_identity(ca, groups, tensors, 16)
    ib = ident.model_identity(cb, groups, tensors, 16)
    assert set(ia) == {"architecture", "model_config", "weights", "dtype", "quantization",
                       "kv_cache_dtype", "num_layers", "num_kv_heads", "head_size",
                       "block_size", "kv_layout", "kv_cache_groups", "pipeline_parallel",
                       "speculative", "kvproto", "vllm"}
    assert ia["architecture"] == "LlamaForCausalLM" and ia["num_layers"] == "2"
    assert ia["num_kv_heads"] == "4" and ia["head_size"] == "32" and ia["block_size"] == "32"
    assert ia["pipeline_parallel"] == "pp=1" and ia["speculative"] == "none"
    assert ia["kv_layout"] == "2x(N,2,H,32,32)[01234]bfloat16"
    assert ia["weights"] == ident.weights_fingerprint(a)[0]
    assert {k for k in ia if ia[k] != ib[k]} == {"weights"}
    pa = ident.model_identity(ca, groups, tensors, 16, pinned="v1")
    pb = ident.model_identity(cb, groups, tensors, 16, pinned="v1")
    assert pa == pb and pa["weights"] == "revision:v1"
    assert all(len(v) <= ident.MAX_VALUE for v in ia.values())
