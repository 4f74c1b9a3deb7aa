"""``nn.MultiheadAttention``, observed (``composite``): every option of torch's layer (``batch_first`` either way,
``attn_mask`` 2-D or 3-D, ``key_padding_mask``, ``is_causal``, ``need_weights``, ``average_attn_weights``, ``kdim`` /
``vdim``, ``add_bias_kv``, ``add_zero_attn``, ``bias=False``, dropout).

The forward below is torch's own (``nn.MultiheadAttention.forward`` outside its inference fast path, then
``F.multi_head_attention_forward``; torch 2.13), the same ops in the same order, so the values are torch's bit for bit
and dropout draws the same masks from the same generator (one view is sized explicitly, so that an empty batch, which
Poisson sampling draws, runs where torch's ``-1`` cannot be inferred). Only its products with parameters are observed:
the query, key and value projections (``in_proj_weight``'s thirds, or ``q_proj_weight``, ``k_proj_weight`` and
``v_proj_weight``, with ``in_proj_bias``'s thirds), the output projection (``out_proj``'s weight and bias, which
``out_proj``'s own forward never sees) and ``bias_k`` / ``bias_v`` (repeated per record). The records are along
dim 1 of the projections' inputs (torch computes sequence first), whatever ``batch_first`` says.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_oso.per_sample.composite import Block, Composite, Slot, register_composite

#: the projections' inputs and outputs are ``[positions, records, features]`` inside the layer
_RECORDS = 1


def _thirds(param: Tensor | None, e: int) -> list[Slot | None]:
    return [None] * 3 if param is None else [(param, i * e, (i + 1) * e) for i in range(3)]


def _whole(param: Tensor | None) -> Slot | None:
    return None if param is None else (param, 0, param.shape[0])


@register_composite(nn.MultiheadAttention)
def multihead_attention(
    c: Composite,
    layer: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    if query.dim() != 3:
        raise ValueError(
            f"nn.MultiheadAttention got an unbatched query ({query.dim()}-d): under per-sample differential privacy "
            "its inputs must carry the records, [n, L, E] with batch_first=True or [L, n, E] without"
        )
    if query.is_nested or key.is_nested or value.is_nested:
        raise AssertionError("MultiheadAttention does not support NestedTensor outside of its fast path")
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=query.dtype,
        check_other=False,
    )
    if layer.batch_first:
        # as torch: the transposes keep the "is" relations that choose the packed projections
        if key is value:
            if query is key:
                query = key = value = query.transpose(1, 0)
            else:
                query, key = (x.transpose(1, 0) for x in (query, key))
                value = key
        else:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    output, weights = _attention(
        c, layer, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
    )
    return (output.transpose(1, 0) if layer.batch_first else output), weights


def _attention(
    c: Composite,
    layer: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
) -> tuple[Tensor, Tensor | None]:
    """``F.multi_head_attention_forward`` with the module's parameters, its projections observed."""
    num_heads, dropout_p = layer.num_heads, layer.dropout
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # scaled_dot_product_attention applies the causal mask itself
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False  # the merged mask is no longer causal
    if embed_dim != layer.embed_dim:
        raise AssertionError(f"was expecting embedding dimension of {layer.embed_dim}, but got {embed_dim}")
    head_dim = embed_dim // num_heads
    q, k, v = _in_projection(c, layer, query, key, value)

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                    f"{(bsz * num_heads, tgt_len, src_len)}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

    if layer.bias_k is not None and layer.bias_v is not None:
        k = torch.cat([k, c.per_record(layer.bias_k.repeat(1, bsz, 1), layer.bias_k, _RECORDS)])
        v = torch.cat([v, c.per_record(layer.bias_v.repeat(1, bsz, 1), layer.bias_v, _RECORDS)])
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))

    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)

    if layer.add_zero_attn:
        zero_attn_shape = (bsz * num_heads, 1, head_dim)
        k = torch.cat([k, torch.zeros(zero_attn_shape, dtype=k.dtype, device=k.device)], dim=1)
        v = torch.cat([v, torch.zeros(zero_attn_shape, dtype=v.dtype, device=v.device)], dim=1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))

    src_len = k.size(1)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            raise AssertionError(f"Expected key_padding_mask of shape {(bsz, src_len)}, got {key_padding_mask.shape}")
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask

    if not layer.training:
        dropout_p = 0.0

    out_proj = layer.out_proj
    out_blocks: list[Block] = [(_whole(out_proj.weight), _whole(out_proj.bias))]
    if need_weights:
        _, _, e = q.shape
        q_scaled = q * math.sqrt(1.0 / float(e))
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        output = torch.bmm(weights, v)
        output = output.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        # as [tgt_len, bsz, E] for the observation (records along dim 1), then torch's [tgt_len * bsz, E] view
        output = c.linear(output.view(tgt_len, bsz, embed_dim), out_proj.weight, out_proj.bias, _RECORDS, out_blocks)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return output, weights
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            # torch's view(bsz, num_heads, -1, src_len) cannot size an empty batch (a Poisson batch may be one)
            attn_mask = attn_mask.view(bsz, num_heads, attn_mask.shape[-2], src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    output = output.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    output = c.linear(output.view(tgt_len, bsz, embed_dim), out_proj.weight, out_proj.bias, _RECORDS, out_blocks)
    return output, None


def _in_projection(
    c: Composite, layer: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """torch's ``_in_projection_packed`` (one product for self-attention, two where key is value) or
    ``_in_projection`` (separate weights for ``kdim`` / ``vdim``), observed by thirds of the packed parameters."""
    e = query.size(-1)
    w, b = layer.in_proj_weight, layer.in_proj_bias
    bias_slots = _thirds(b, e)
    bias_parts: list[Tensor | None] = [None] * 3 if b is None else list(b.chunk(3))
    if not layer._qkv_same_embed_dim:
        weights = (layer.q_proj_weight, layer.k_proj_weight, layer.v_proj_weight)
        return tuple(  # type: ignore[return-value]
            c.linear(x, weight, bias, _RECORDS, [(_whole(weight), slot)])
            for x, weight, bias, slot in zip((query, key, value), weights, bias_parts, bias_slots)
        )
    weight_slots = _thirds(w, e)
    blocks: list[Block] = list(zip(weight_slots, bias_slots))
    if key is value:
        if query is key:
            proj = c.linear(query, w, b, _RECORDS, blocks)
            proj = proj.unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return proj[0], proj[1], proj[2]
        w_q, w_kv = w.split([e, e * 2])
        b_q, b_kv = (None, None) if b is None else b.split([e, e * 2])
        q_proj = c.linear(query, w_q, b_q, _RECORDS, blocks[:1])
        kv_proj = c.linear(key, w_kv, b_kv, _RECORDS, blocks[1:])
        kv_proj = kv_proj.unflatten(-1, (2, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        return q_proj, kv_proj[0], kv_proj[1]
    w_q, w_k, w_v = w.chunk(3)
    return (
        c.linear(query, w_q, bias_parts[0], _RECORDS, blocks[:1]),
        c.linear(key, w_k, bias_parts[1], _RECORDS, blocks[1:2]),
        c.linear(value, w_v, bias_parts[2], _RECORDS, blocks[2:]),
    )
