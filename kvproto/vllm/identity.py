"""The model identity a vLLM engine sends in kvproto's handshake (spec/VLLM.md §1).

KV bytes mean something only for the model that wrote them: two engines may exchange KV
only if they run the same architecture with the same weights, in the same dtype and
geometry, with the same KV layout and cache groups, the same speculative decoding and
compatible software. ``model_identity`` collects these facts as a mapping of short field
names to short strings; P and D send it in the handshake and refuse a peer whose mapping
differs in any field (``kvproto.wire.check_identity``), before any READ. The mapping (not
one hash) travels so that a refusal names the field that differed.

The weights are identified by ``weights_fingerprint``: a SHA-256 over the name, size and
sampled bytes of every file of the checkpoint, computed once when the engine starts
(after vLLM loaded the weights, so a checkpoint replaced in place later does not change
what a running engine announces). It tells apart two checkpoints of one shape whether
they sit at two paths or one replaced the other at the same path, and it does not depend
on the path (copies of one checkpoint match). Its cost is bounded: files up to
``WHOLE_FILE_BYTES`` are read whole, larger ones at ``SAMPLE_BYTES`` every
``SAMPLE_STRIDE`` bytes (at most ``MAX_SAMPLES`` per file). A change confined to bytes
between two samples (one small tensor edited in place) is not seen: deployments that
edit checkpoints that way pin a revision instead (``kv_connector_extra_config``
``model_revision``), which replaces the fingerprint.

Not compared: the model's path or name (copies at two paths are the same model), the
number of KV blocks (P and D size their caches independently) and anything that only
schedules (batch sizes, lengths).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvproto.errors import UsageError

log = logging.getLogger(__name__)

WHOLE_FILE_BYTES = 1 << 20  # files up to this size are hashed whole (configs, tokenizers)
SAMPLE_STRIDE = 16 << 20  # larger files: one sample per this many bytes ...
SAMPLE_BYTES = 4096  # ... of this many bytes (one page), the first and the last included
MAX_SAMPLES = 4096  # samples per file at most (a 64 GiB file is sampled every 16 MiB)
MAX_FILES = 100_000  # files of one checkpoint at most (more: the fingerprint refuses)
FINGERPRINT_HEX = 32  # hex digits of the fingerprint kept (128 bits)
MAX_VALUE = 200  # longer identity values are sent as their digest


class FingerprintError(UsageError, ValueError):
    """The checkpoint cannot be fingerprinted (missing, unreadable, too many files)."""


def _files(root: Path) -> list[tuple[str, Path]]:
    """(name relative to root, path) of every regular file under ``root``, sorted; hidden
    files and directories (``.cache``, ``.git``: local bookkeeping, not the model) are
    left out. Symbolic links to files are followed (the Hugging Face cache's snapshots
    are links to blobs)."""
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise FingerprintError(f"{root} is neither a file nor a directory")
    out: list[tuple[str, Path]] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for n in names:
            if n.startswith("."):
                continue
            p = Path(d) / n
            if p.is_file():
                out.append((p.relative_to(root).as_posix(), p))
                if len(out) > MAX_FILES:
                    raise FingerprintError(f"{root} holds more than {MAX_FILES} files")
    if not out:
        raise FingerprintError(f"{root} holds no file")
    return sorted(out)


def _offsets(size: int) -> list[int]:
    """Evenly spaced sample offsets of a file larger than ``WHOLE_FILE_BYTES``: the first
    and the last ``SAMPLE_BYTES`` included, at most ``SAMPLE_STRIDE`` apart (at most
    ``MAX_SAMPLES``)."""
    last = size - SAMPLE_BYTES
    n = min(MAX_SAMPLES, max(2, -(-last // SAMPLE_STRIDE) + 1))
    return [last * i // (n - 1) for i in range(n)]


def weights_fingerprint(path: str | os.PathLike[str]) -> tuple[str, int]:
    """Fingerprint of the checkpoint at ``path`` (a directory or one file): returns
    ("sha256:<hex>", bytes read). Depends on each file's name relative to ``path``, its
    size and its sampled bytes; not on ``path`` itself, times or owners."""
    root = Path(path)
    h = hashlib.sha256(b"kvproto-weights-1\0")
    nread = 0
    for name, p in _files(root):
        try:
            with open(p, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\0{size}\0".encode())
                if size <= WHOLE_FILE_BYTES:
                    data = f.read()
                    h.update(data)
                    nread += len(data)
                    continue
                fd = f.fileno()
                for off in _offsets(size):
                    data = os.pread(fd, SAMPLE_BYTES, off)
                    h.update(data)
                    nread += len(data)
        except OSError as e:
            raise FingerprintError(f"cannot read {p}: {e}") from None
    return "sha256:" + h.hexdigest()[:FINGERPRINT_HEX], nread


def _digest(obj: Any) -> str:
    """A short digest of a JSON-able structure (keys sorted; other values by ``str``)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:FINGERPRINT_HEX]


def _hf_config_digest(hf_config: Any) -> str:
    """The model configuration vLLM runs (after any override), without the keys that
    name where it came from (``_name_or_path``, ``_commit_hash``, ...) or which
    transformers wrote it."""
    try:
        d = hf_config.to_dict()
    except Exception:  # not a transformers config: its attributes
        d = dict(vars(hf_config))
    return _digest({k: v for k, v in d.items()
                    if not k.startswith("_") and k != "transformers_version"})


def resolve_weights_path(model: str, revision: str | None = None,
                         download_dir: str | None = None) -> Path | None:
    """The local directory or file of ``model``: itself when it exists here, else the
    Hugging Face cache's snapshot of it (no network); None when neither is found."""
    p = Path(model).expanduser()
    if p.exists():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, cache_dir=download_dir,
                                      local_files_only=True))
    except Exception as e:
        log.debug("kvproto: no local snapshot of %s: %s", model, e)
        return None


def weights_identity(model: str, *, revision: str | None = None, load_format: str = "auto",
                     download_dir: str | None = None, pinned: str | None = None) -> str:
    """The ``weights`` field: ``revision:<pinned>`` when the user pinned one, else the
    fingerprint of the local checkpoint. vLLM's ``dummy`` weights (random, no files) are
    ``dummy``. Raises FingerprintError when the checkpoint cannot be found here (pin a
    revision then)."""
    if pinned is not None:
        return "revision:" + pinned
    if load_format == "dummy":
        return "dummy"
    path = resolve_weights_path(model, revision, download_dir)
    if path is None:
        raise FingerprintError(f"no local files of {model!r} to fingerprint; set "
                               "kv_connector_extra_config model_revision to identify them")
    fp, nread = weights_fingerprint(path)
    log.info("kvproto: weights of %s fingerprinted (%s, %d bytes read)", model, fp, nread)
    return fp


def kv_layout(tensors: Sequence[Any], num_blocks: int, heads: int | None = None) -> str:
    """The KV tensors' shapes (the block dimension, the first of size ``num_blocks``,
    written ``N``), strides order and dtypes: what a block's bytes hold, independent of
    how many blocks the cache has. With ``heads`` (this rank's KV heads), the first
    dimension after the block dimension of that size is written ``H``: the layout of one
    head's slice, the same at every tensor-parallel size (vLLM's CPU layout is (N, H,
    block size, 2 x head size)). Should another dimension before the heads have the same
    size, the two sides write ``H`` in different places and are refused, never paired
    wrongly."""
    seen: set[int] = set()
    parts: list[str] = []
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        shape = list(t.shape)
        nb = shape.index(num_blocks) if num_blocks in shape else -1
        hd = next((i for i in range(nb + 1, len(shape)) if shape[i] == heads), -1) \
            if heads is not None and nb >= 0 else -1
        dims = ["N" if i == nb else "H" if i == hd else str(s) for i, s in enumerate(shape)]
        order = sorted(range(len(shape)), key=lambda i: -t.stride()[i])
        parts.append(f"({','.join(dims)})[{''.join(map(str, order))}]"
                     f"{str(t.dtype).replace('torch.', '')}")
    counts: dict[str, int] = {}
    for x in parts:
        counts[x] = counts.get(x, 0) + 1
    return "+".join(f"{n}x{x}" for x, n in counts.items())


def _groups(kv_cache_config: Any) -> str:
    """The KV cache groups: per group its spec's kind, block size and layer count."""
    out = []
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = g.kv_cache_spec
        out.append(f"{type(spec).__name__}/{getattr(spec, 'block_size', '?')}/"
                   f"{len(g.layer_names)}")
    return ";".join(out) or "none"


def _speculative(vllm_config: Any, target_weights: str) -> str:
    """Speculative decoding: method, tokens per step and the draft model's weights (the
    target's when the draft is the target model itself, e.g. MTP)."""
    sc = vllm_config.speculative_config
    if sc is None:
        return "none"
    draft = sc.draft_model_config
    dw = "none"
    if draft is not None:
        if str(draft.model) == str(vllm_config.model_config.model):
            dw = target_weights
        else:
            lc = vllm_config.load_config
            dw = weights_identity(str(draft.model), revision=draft.revision,
                                  load_format=str(lc.load_format),
                                  download_dir=lc.download_dir)
    return f"{sc.method}:{sc.num_speculative_tokens}:{dw}"


def kvproto_version() -> str:
    """kvproto's distribution version and its handshake version."""
    from importlib.metadata import PackageNotFoundError, version

    from kvproto.wire import HANDSHAKE_VERSION

    try:
        v = version("kvproto")
    except PackageNotFoundError:
        v = "source"
    return f"{v}/handshake-{HANDSHAKE_VERSION}"


def model_identity(vllm_config: Any, kv_cache_config: Any, tensors: Sequence[Any],
                   num_blocks: int, *, pinned: str | None = None) -> dict[str, str]:
    """The identity fields of this engine worker (see the module docstring). Reads
    vLLM's ``VllmConfig`` (model, cache, parallel, speculative and load configs), the
    scheduler's ``KVCacheConfig`` and the registered KV tensors; fingerprints the weights
    unless ``pinned`` names a revision."""
    import vllm

    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    lc = vllm_config.load_config
    weights = weights_identity(str(mc.model), revision=mc.revision,
                               load_format=str(lc.load_format), download_dir=lc.download_dir,
                               pinned=pinned)
    total_heads = int(mc.get_total_num_kv_heads())
    ident = {
        "architecture": ",".join(getattr(mc.hf_config, "architectures", None) or []),
        "model_config": _hf_config_digest(mc.hf_config),
        "weights": weights,
        "dtype": str(mc.dtype).replace("torch.", ""),
        "quantization": str(mc.quantization),
        "kv_cache_dtype": str(cc.cache_dtype),
        "num_layers": str(mc.get_total_num_hidden_layers()),
        "num_kv_heads": str(total_heads),
        "head_size": str(mc.get_head_size()),
        "block_size": str(cc.block_size),
        "kv_layout": kv_layout(tensors, num_blocks,
                               heads=max(1, total_heads // pc.tensor_parallel_size)),
        "kv_cache_groups": _groups(kv_cache_config),
        # Tensor parallelism may differ between P and D (the handshake's Layout carries
        # each side's TP size and rank, and the rank mapping is derived from them and
        # num_kv_heads: kvproto.lifecycle.topology); pipeline stages must agree.
        "pipeline_parallel": f"pp={pc.pipeline_parallel_size}",
        "speculative": _speculative(vllm_config, weights),
        "kvproto": kvproto_version(),
        "vllm": str(vllm.__version__),
    }
    # A value the handshake cannot carry (wire.MAX_IDENTITY_VALUE) travels as its digest.
    return {k: v if len(v) <= MAX_VALUE else _digest(v) for k, v in ident.items()}
