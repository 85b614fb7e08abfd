"""MoA inside vLLM's engine: the proposer and what it drafts with (imported by vLLM's worker
processes through the names in shell/compat.py).

    proposer.py           MoAProposer: vLLM's draft-model proposer + the tap; the order of a step
    target_layers.py      which of vLLM's attention layers are the target's, and the checks on them
    tap.py                index arithmetic of the tap on vLLM's paged caches (pure torch, no host sync)
    draft_model.py        the vLLM-native MoA drafter (SA/CA from vLLM layers, LSA through
                          vllm_moa.kernels): vLLM's draft loop, the tap's rows, weights
    draft_attention.py    CA's and the TLI layers' attention metadata and slots in vLLM's draft loop
    tree_levels.py        the drafter's tree levels (the same SA/CA blocks, a dense tree mask)
    catch_up.py           steps vLLM schedules without drafts: skipped, then caught up
    lookup_drafts.py      lookup drafts beside the model's (moa_retrieval)
    tree_drafts.py        draft trees grown per step (EAGLE-2, all requests' levels together) and
                          handed to verification
    tree_verification.py  draft trees verified inside vLLM's engine (positions by depth, the tree
                          mask, acceptance, accepted KV moved to the chain's slots)
    tree_or_chain.py      moa_tree.chain_if_faster: each step the tree or the chain of its budget
    tensor_parallel.py    the tap's gather across ranks, fp8 packing, the draft vocabulary's rows
"""
