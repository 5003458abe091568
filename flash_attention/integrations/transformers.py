"""flash_attention as an attention implementation of Hugging Face transformers (>= 4.53).

    import flash_attention.integrations.transformers as fa_hf
    fa_hf.register()  # returns "fa_cute"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa_cute", dtype=torch.bfloat16)

register() adds attention_forward to transformers.AttentionInterface and padding_mask to
transformers.masking_utils.AttentionMaskInterface under one name. The mask builder is what makes the model hand over
a 2-D padding mask, as it does for flash_attention_2, instead of a 4-D one; AttentionMaskInterface appeared in 4.53,
hence the lower bound. The name holds no "flash" on purpose: transformers 5 treats every attn_implementation
containing "flash" as a request for the flash-attn package or a Hub kernel and fails to load it.

Batches with padding are unpadded and run through flash_attn_varlen_func; sequences packed into one row (position_ids
restarting, as DataCollatorWithFlattening makes them, or cu_seq_lens_q/k passed to the model) run as separate
sequences; everything else runs through flash_attn_func.
"""

import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

import flash_attention
from flash_attention._dispatch import DTYPE_NAMES

NAME = "fa_cute"
MIN_TRANSFORMERS_VERSION = "4.53.0"
_HALF = tuple(DTYPE_NAMES)  # the dtypes the kernels take


def register(name: str = NAME) -> str:
    """Register the attention function and its mask builder with transformers under `name`; returns `name`, the
    value for attn_implementation. Registration is global to the process and may be repeated."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{__name__} needs transformers >= {MIN_TRANSFORMERS_VERSION}") from e
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS_VERSION):
        raise ImportError(
            f"{__name__} needs transformers >= {MIN_TRANSFORMERS_VERSION}, found {transformers.__version__}: older "
            "versions give custom attention functions a 4-D mask, not the 2-D padding mask this one unpads with"
        )
    if "flash" in name:
        raise ValueError(
            f"attn_implementation name {name!r} contains 'flash': transformers would try to load the flash-attn "
            "package or a Hub kernel under that name instead of calling this implementation"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(
    *,
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    attention_mask: Optional[torch.Tensor] = None,
    mask_function=None,
    **kwargs,
) -> Optional[torch.Tensor]:
    """Mask builder called by transformers' create_*_mask: the 2-D padding mask (batch, keys), or None when no key
    is padding. Causality and windows are not in it: attention_forward passes them to the kernel.

    A given attention_mask is cut to its last kv_length columns (a sliding-window cache keeps only those keys), as
    transformers' flash_attention_mask does. When it is shorter than kv_length (a static cache has slots past the
    tokens written), attention_forward keeps only the keys it covers. Without one, a causal mask over a static cache
    gets an all-ones mask of the written slots for the same reason: generate() drops an all-ones attention_mask for
    every implementation but transformers' own flash ones, so this is the only place that sees those slots."""
    # Chunked attention (Llama 4) is not a window the kernels have; transformers refuses it for flash-attn the same way.
    chunk_size = getattr(kwargs.get("config"), "attention_chunk_size", None)
    if chunk_size is not None and kv_offset + kv_length > chunk_size:
        raise NotImplementedError(
            f"attn_implementation={NAME!r} cannot do chunked attention (attention_chunk_size={chunk_size}) over "
            f"{kv_offset + kv_length} tokens: use another implementation"
        )
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and attention_mask.all():
            return None
        return attention_mask
    # The queries' positions: transformers >= 5.10 passes q_offset and q_length, older versions cache_position.
    cache_position = kwargs.get("cache_position")
    q_length = len(cache_position) if cache_position is not None else kwargs["q_length"]
    if kv_length <= q_length:  # no cache: nothing to cut (and no device sync for the positions)
        return None
    end = int(cache_position[-1]) + 1 if cache_position is not None else int(kwargs["q_offset"]) + q_length
    written = end - kv_offset
    if written >= kv_length or mask_function is None:
        return None
    # Only a causal mask hides the unwritten slots; a bidirectional one (cross-attention: no cache, more keys than
    # queries) must keep every key. Mask functions take tensor indices: does query 0 see key 1?
    device = cache_position.device if cache_position is not None else kwargs.get("device")
    if mask_function(*torch.tensor([0, 0, 0, 1], device=device)):
        return None
    return torch.ones(batch_size, written, dtype=torch.bool, device=device)


def window_size(sliding_window: Optional[int], causal: bool) -> Tuple[int, int]:
    """flash-attn's window_size for transformers' sliding_window. transformers' masks let query i see key j iff
    i - j < sliding_window (causal) or |i - j| < sliding_window (bidirectional), so the inclusive bound is
    sliding_window - 1. (transformers' flash_attention_2 does the same from 4.56 on; before, it passed
    sliding_window, one key more than its own masks.)"""
    if sliding_window is None:
        return -1, -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    left = int(sliding_window) - 1
    return left, 0 if causal else left


def unpad_indices(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """For a padding mask (batch, seqlen), nonzero at tokens: the tokens' indices into the flattened (batch * seqlen)
    rows, int32 cu_seqlens (batch + 1,) and the longest sequence's length."""
    mask = mask.bool()
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten()).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max())


def unpad(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, ...) -> (len(indices), ...): the rows of the flattened first two dims at indices."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, indices)


def pad(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of unpad: (len(indices), ...) -> (batch, seqlen, ...) with zeros at the rows not in indices."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:]).index_copy(0, indices, x)
    return out.view(batch, seqlen, *x.shape[1:])


def packed_cu_seqlens(position_ids: Optional[torch.Tensor], seqlen: int) -> Optional[Tuple[torch.Tensor, int]]:
    """(cu_seqlens, max_seqlen) of the sequences packed into one row of `seqlen` tokens, each starting where the
    position id is back at its smallest value (0, or padding_idx + 1 for RoBERTa-like models), as transformers'
    flash path reads them; None when position_ids is not (1, seqlen) or holds a single sequence."""
    if position_ids is None or position_ids.shape != (1, seqlen) or seqlen < 2:
        return None
    pos = position_ids[0]
    first = pos == pos.min()
    first[0] = True  # the row starts a sequence even if its first position id is not the smallest
    starts = torch.nonzero(first).flatten()
    if starts.numel() == 1:
        return None
    cu_seqlens = F.pad(starts.to(torch.int32), (0, 1), value=seqlen)
    return cu_seqlens, int(cu_seqlens.diff().max())


def compute_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype:
    """The half dtype to run in. fp32 inputs are cast like transformers' flash path does: to the autocast dtype, or
    to the projections' dtype when those are half (fp32 layer norms in a half model, as PEFT makes). A model that is
    fp32 throughout has no half dtype to fall back to, and is refused."""
    if query.dtype in _HALF:
        return query.dtype
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) in _HALF:
        return torch.get_autocast_dtype(device_type)
    weight_dtype = next((m.weight.dtype for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if weight_dtype in _HALF:
        return weight_dtype
    raise TypeError(
        f"attn_implementation={NAME!r} runs in fp16 or bf16, got {query.dtype} activations from a model without "
        "half-precision weights: load the model with dtype=torch.bfloat16 (or float16), or run it under torch.autocast"
    )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (batch, heads, seqlen_q, head_dim), key/value (batch,
    kv_heads, seqlen_k, head_dim), attention_mask None or the 2-D padding mask from padding_mask; returns
    (output (batch, seqlen_q, heads, head_dim), None). Causal per module.is_causal unless kwargs["is_causal"] says
    otherwise; with a KV cache the queries are the last positions of the keys (bottom-right aligned)."""
    for name in ("s_aux", "position_bias", "cache"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation={NAME!r} does not support {name} (attention sinks, "
                                      "additive position biases and paged caches need another implementation)")
    if dropout > 0.0 and module.training:
        raise NotImplementedError(
            f"attn_implementation={NAME!r} has no attention dropout: set the config's attention dropout to 0.0 "
            f"(got {dropout}) or call model.eval()"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attn_implementation={NAME!r} takes a 2-D padding mask (batch, seqlen), got shape "
            f"{tuple(attention_mask.shape)}: pass a 2-D attention_mask, or use this model with another implementation"
        )
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:  # transformers' switch for flash-attn's deterministic backward
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    options = dict(
        softmax_scale=scaling,
        causal=bool(is_causal),
        window_size=window_size(sliding_window, bool(is_causal)),
        softcap=0.0 if softcap is None else float(softcap),
        deterministic=bool(deterministic),
    )

    dtype = compute_dtype(query, module)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))
    batch, seqlen_q, _, head_dim = q.shape
    # The kernels need one head dim for q, k and v: a narrower v (MLA) is zero-padded and its extra columns cut off.
    v_head_dim = v.shape[-1]
    if v_head_dim != head_dim:
        v = F.pad(v, (0, head_dim - v_head_dim))

    cu_seqlens_q, cu_seqlens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    packed = None
    if attention_mask is None and cu_seqlens_q is None and batch == 1 and seqlen_q == k.shape[1]:
        packed = packed_cu_seqlens(kwargs.get("position_ids"), seqlen_q)
    if attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, options)
    elif cu_seqlens_q is not None and cu_seqlens_k is not None:
        cu_seqlens_q, cu_seqlens_k = (c.to(device=q.device, dtype=torch.int32) for c in (cu_seqlens_q, cu_seqlens_k))
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(cu_seqlens_q.diff().max()) if max_q is None else int(max_q)
        max_k = int(cu_seqlens_k.diff().max()) if max_k is None else int(max_k)
        out = flash_attention.flash_attn_varlen_func(
            *(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), cu_seqlens_q, cu_seqlens_k, max_q, max_k, **options
        ).view(batch, seqlen_q, *q.shape[2:])
    elif packed is not None:
        cu_seqlens, max_seqlen = packed
        out = flash_attention.flash_attn_varlen_func(
            q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options
        ).unsqueeze(0)
    else:
        out = flash_attention.flash_attn_func(q, k, v, **options)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _padded_attention(q, k, v, attention_mask, options):
    """Attention over a padded batch through the varlen kernel. The keys of every sequence are unpadded; the queries
    too where their positions matter, as causal masks and windows align each sequence's last query with its last key.
    Otherwise (bidirectional attention without a window, which cross-attention also is, or one decoding step) every
    query row is computed: the mask may belong to other tokens (an encoder's), and a padded query's output is unused."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k, mask_len = k.shape[1], attention_mask.shape[1]
    if seqlen_k > mask_len:  # a static cache hands over all its slots; the mask covers the ones written
        k, v = k[:, :mask_len], v[:, :mask_len]
    else:
        attention_mask = attention_mask[:, -seqlen_k:]
    indices_k, cu_seqlens_k, max_k = unpad_indices(attention_mask)
    k, v = unpad(k, indices_k), unpad(v, indices_k)
    if seqlen_q > 1 and (options["causal"] or options["window_size"] != (-1, -1)):
        if seqlen_q == attention_mask.shape[1]:
            indices_q, cu_seqlens_q, max_q = indices_k, cu_seqlens_k, max_k
        else:  # with a KV cache the queries are the newest tokens, the mask's last columns
            indices_q, cu_seqlens_q, max_q = unpad_indices(attention_mask[:, -seqlen_q:])
        out = flash_attention.flash_attn_varlen_func(
            unpad(q, indices_q), k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, **options
        )
        return pad(out, indices_q, batch, seqlen_q)
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    out = flash_attention.flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k, v, cu_seqlens_q, cu_seqlens_k, seqlen_q, max_k, **options
    )
    return out.view(batch, seqlen_q, *out.shape[1:])
