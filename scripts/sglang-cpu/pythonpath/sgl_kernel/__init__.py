"""A stand-in for the CPU build of `sgl_kernel`, which no registry ships, for SGLang 0.5.20 on `--device cpu`.

SGLang imports these names from `sgl_kernel` at module level on a CPU, but calls them only for speculative decoding
and for raw-pointer KV-slot moves (which SGLANG_NATIVE_MOVE_KV_CACHE=1 does with torch indexing instead). Plain
serving, batched or not, with pauses and weight updates, never calls them: each one refuses, so a path that
starts to call them fails loudly instead of computing something untested. No `torch.ops.sgl_kernel` op is
registered, so SGLang finds no AMX kernels and takes its native-torch paths everywhere.
"""

from collections.abc import Callable


def _not_provided(name: str) -> Callable[..., None]:
    def refuse(*args, **kwargs) -> None:
        raise NotImplementedError(
            f"sgl_kernel stand-in: {name} is not provided (run SGLang without speculative decoding and with "
            "SGLANG_NATIVE_MOVE_KV_CACHE=1)"
        )

    refuse.__name__ = name
    return refuse


assign_req_to_token_pool_cpu = _not_provided("assign_req_to_token_pool_cpu")
copy_all_layer_kv_cache_cpu = _not_provided("copy_all_layer_kv_cache_cpu")
build_tree_kernel_efficient_cpu = _not_provided("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_provided("verify_tree_greedy_cpu")
assign_extend_cache_locs_cpu = _not_provided("assign_extend_cache_locs_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_provided("assign_draft_cache_locs_contiguous_cpu")
rotate_input_ids_cpu = _not_provided("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = _not_provided("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_provided("fill_bonus_tokens_cpu")
