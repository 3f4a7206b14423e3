# Stand-in for sgl_kernel's CPU build (not on PyPI): 0.5.23 imports *_cpu ops under SGLANG_USE_CPU_ENGINE=1.
def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc (plain torch)."""
    offset = 0
    runs = zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True)
    for pool, start, end in runs:
        n = end - start
        req_to_token[pool, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    raise NotImplementedError("sgl_kernel.copy_all_layer_kv_cache_cpu is not available (stand-in)")


def _unavailable(name):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available (stand-in)")

    op.__name__ = name
    return op


# Speculative-decoding ops, imported under is_cpu() by kernels/ops/speculative/*.py; unused here.
for _name in (
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
):
    globals()[_name] = _unavailable(_name)
del _name
