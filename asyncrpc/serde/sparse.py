"""Sparse tensors travel as their strided parts: indices and values, out of band.

Theory of operation
-------------------
A sparse tensor (COO, or a compressed layout: CSR, CSC, BSR, BSC) reduces to
``load_sparse(meta, parts)``.  Its *parts* are the strided tensors it is made of
(COO: indices and values; compressed layouts: compressed indices, plain indices
and values), taken from it without its graph; the pickler reduces each one as it
reduces any strided tensor, so their bytes leave out of band, zero-copy.  The
receiver rebuilds the tensor from them with its invariants checked (the parts
come from another process, and an index out of bounds would be a memory error
later, in some kernel), and with ``requires_grad`` and Parameter-ness as sent, as
for strided tensors.

torch's own pickling is not used: its rebuild appends each tensor to a list
(``torch._utils._sparse_tensors_to_validate``) that only ``torch.load`` validates
and empties, so every sparse tensor unpickled elsewhere would stay alive for good.
"""

from __future__ import annotations

import torch

from asyncrpc.errors import SerializationError

SparseMeta = tuple[str, tuple[int, ...], bool, bool, bool]
"""(layout name, shape, is_coalesced (COO), requires_grad, is_parameter)"""

_COMPRESSED_ROWS = (torch.sparse_csr, torch.sparse_bsr)  # crow_indices, col_indices
_COMPRESSED_COLUMNS = (torch.sparse_csc, torch.sparse_bsc)  # ccol_indices, row_indices
_NAMES: dict[torch.layout, str] = {
    layout: str(layout).removeprefix("torch.")
    for layout in (torch.sparse_coo, *_COMPRESSED_ROWS, *_COMPRESSED_COLUMNS)
}
_LAYOUTS: dict[str, torch.layout] = {name: layout for layout, name in _NAMES.items()}


def dump_sparse(tensor: torch.Tensor) -> tuple[SparseMeta, tuple[torch.Tensor, ...]] | None:
    """Split a sparse tensor into meta and its strided parts; None if it is not sparse."""
    name = _NAMES.get(tensor.layout)
    if name is None:
        return None
    data = tensor.detach()
    meta: SparseMeta = (
        name,
        tuple(data.shape),
        data.layout is torch.sparse_coo and data.is_coalesced(),
        tensor.requires_grad,
        isinstance(tensor, torch.nn.Parameter),
    )
    return meta, _parts(data)


def _parts(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    layout = data.layout
    if layout is torch.sparse_coo:
        return data._indices(), data._values()
    if layout in _COMPRESSED_ROWS:
        return data.crow_indices(), data.col_indices(), data.values()
    return data.ccol_indices(), data.row_indices(), data.values()


def load_sparse(meta: SparseMeta, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Rebuild a sparse tensor from its meta and its received parts, checking its
    invariants (raises :class:`SerializationError` if they do not hold)."""
    layout_name, shape, coalesced, requires_grad, is_parameter = meta
    layout = _LAYOUTS.get(layout_name)
    if layout is None:
        raise SerializationError(f"unknown sparse tensor layout {layout_name!r}")
    try:
        tensor = _build(layout, shape, coalesced, parts)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise SerializationError(f"received an invalid {layout_name} tensor: {exc}") from exc
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _build(
    layout: torch.layout, shape: tuple[int, ...], coalesced: bool, parts: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    if layout is torch.sparse_coo:
        indices, values = parts
        return torch.sparse_coo_tensor(
            indices, values, shape, is_coalesced=coalesced, check_invariants=True
        )
    compressed, plain, values = parts
    return torch.sparse_compressed_tensor(
        compressed, plain, values, shape, layout=layout, check_invariants=True
    )
