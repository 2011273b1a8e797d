"""dpo.reference precompute kept in the training-checkpoint store, so a restarted run does not redo the pass."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit.distributed.strategies import unwrap

log = logging.getLogger("memfit.train")
PREFIX = "reference"  # beside the step-NNNNNNNN/ folders; the checkpoint index lists and prunes only those


def weights_fingerprint(model: nn.Module, samples: int = 4096) -> str:
    """The starting weights, cheaply and without a full-size temporary: each tensor's name, shape and dtype, its
    sum (in its own dtype) and `samples` evenly spaced values (one host read for all). Enough to tell another
    starting point (a new base, other adapters, a quantized copy) from the same one."""
    names, parts = [], []
    for name, whole in _whole_tensors(unwrap(model)):  # the module's names under any wrapper
        flat = whole.detach().reshape(-1)
        if not flat.numel():
            continue
        names.append(f"{name}:{tuple(whole.shape)}:{whole.dtype}")
        idx = torch.linspace(0, flat.numel() - 1, min(samples, flat.numel()), device=flat.device).long()
        total = flat.sum().reshape(1) if whole.is_floating_point() else flat[:0]
        parts.append(torch.cat([total.double(), flat[idx].double()]))
    values = torch.cat(parts).cpu().numpy().tobytes() if parts else b""
    return hashlib.sha256("\n".join(names).encode() + values).hexdigest()[:24]


def _whole_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of the state dict, one at a time: an FSDP2 DTensor's full_tensor(), a ZeRO-3 partitioned
    parameter gathered for as long as the caller reads it (both collective: every rank goes in this order)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in model.state_dict().items():
        p = params.get(name)
        if p is not None and hasattr(p, "ds_tensor"):  # ZeRO-3: the state dict holds an empty placeholder
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                yield name, p.data
            continue
        full = getattr(t, "full_tensor", None)
        yield name, full() if callable(full) else t


def cache_key(model: nn.Module, data: Any, batch_size: int, precision: str) -> str:
    """The object name of one precompute: the pairs (both splits, every field but the stored log-probs), the
    starting weights, and what changes the numbers (micro-batch, precision)."""
    from memfit.data.pairs import pairs_digest

    parts = [str(batch_size), precision, weights_fingerprint(model), pairs_digest(data.train, data.train_fields),
             pairs_digest(data.val, data.val_fields)]
    h = hashlib.sha256("|".join(parts).encode())
    return f"{PREFIX}/ref-logps-{h.hexdigest()[:32]}.safetensors"


def load(store: Any, key: str, data: Any, names: tuple[str, str]) -> bool:
    """The stored log-probs into data's fields when the object exists and holds one value per pair of each side;
    False (and a line saying why, for a damaged one) otherwise: then the pass runs again."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    from memfit.errors import StorageError

    try:
        if not store.exists(key):
            return False
        tensors = load_bytes(store.get_bytes(key))
        loaded = {}
        for split, rows in (("train", data.train), ("val", data.val)):
            for name in names:
                t = tensors[f"{split}.{name}"]
                if t.shape != (len(rows),) or t.dtype != torch.float32 or not torch.isfinite(t).all():
                    raise ValueError(f"{split}.{name} has shape {tuple(t.shape)}, dtype {t.dtype}; expected "
                                     f"({len(rows)},) float32, finite")
                loaded[(split, name)] = t
    except (KeyError, ValueError, SafetensorError, OSError, StorageError) as err:
        log.warning("dpo.reference precompute: %s/%s is unusable (%s): computing the reference log-probs again",
                    store.uri.rstrip("/"), key, err)
        return False
    for (split, name), t in loaded.items():
        (data.train_fields if split == "train" else data.val_fields)[name] = t
    return True


def agreed(found: bool) -> bool:
    """Under torchrun every rank reads the kept values or none does: FSDP2's reference pass is collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return found
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1.0 if found else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save(store: Any, key: str, data: Any, names: tuple[str, str]) -> None:
    """One safetensors object (no pickle), written whole: a store's put is atomic (temporary name, then rename)."""
    from safetensors.torch import save as save_bytes

    tensors = {f"{split}.{name}": fields[name].contiguous()
               for split, fields in (("train", data.train_fields), ("val", data.val_fields)) for name in names}
    try:
        store.put_bytes(key, save_bytes(tensors))
    except Exception as err:  # noqa: BLE001 - a cache: training goes on, a restart computes it again
        log.warning("dpo.reference precompute: could not keep the log-probs at %s/%s (%s); a restart will "
                    "compute them again", store.uri.rstrip("/"), key, err)
