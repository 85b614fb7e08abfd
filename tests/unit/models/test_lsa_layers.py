"""LSA over a subset of the target's layers (config lsa_layer_stride): which layers are read, and
that only those are read on every path (incremental drafting, the paged-cache twin). Training-mode
logits equal incremental drafting with a subset too: test_moa_equivalence.py."""

import pytest
import torch
from tiny_models import make_target

from vllm_moa.config import DrafterConfigError
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.target import stack_layer_kv


def make_drafter(target, stride: int, tli: int = 0) -> MoADrafter:
    torch.manual_seed(5)
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=tli, lsa_layer_stride=stride, lsa_num_heads=4,
                                   lsa_intermediate_size=64, sa_num_heads=4, sa_num_kv_heads=2, sa_head_dim=16,
                                   sa_intermediate_size=64, ca_num_heads=4, ca_num_kv_heads=1, ca_head_dim=16,
                                   ca_intermediate_size=64))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
    return drafter.eval()


@pytest.mark.parametrize("num_layers,stride,want", [(30, 1, tuple(range(30))), (30, 3, tuple(range(2, 30, 3))),
                                                    (30, 2, tuple(range(1, 30, 2))), (4, 3, (0, 3)), (4, 4, (3,))])
def test_layers_read_end_at_the_last_layer(num_layers, stride, want):
    target = make_target("llama", num_hidden_layers=num_layers)
    assert MoAConfig(target=target.signature, lsa_layer_stride=stride).lsa_layers == want


@pytest.mark.parametrize("stride", [0, 5])
def test_stride_out_of_range_is_refused_by_name(stride):
    target = make_target("llama")  # 4 layers
    with pytest.raises(DrafterConfigError, match="lsa_layer_stride"):
        MoADrafter(MoAConfig(target=target.signature, lsa_layer_stride=stride))


def test_rows_depend_on_the_layers_read_only():
    """Changing an unread layer's K/V leaves the rows as they are; changing a read one does not."""
    target = make_target("llama")  # 4 layers; stride 2 reads layers 1 and 3
    drafter = make_drafter(target, 2)
    assert drafter.lsa.layers == (1, 3)
    with torch.no_grad():
        out = target(torch.randint(0, 97, (1, 9)))
        rows = drafter.rows_from_kv(out.keys, out.values)
        for layer, changes in ((0, False), (2, False), (1, True), (3, True)):
            keys = [k + 1.0 if i == layer else k for i, k in enumerate(out.keys)]
            moved = (drafter.rows_from_kv(keys, out.values) - rows).abs().max().item()
            assert (moved > 1e-3) == changes, f"layer {layer}: rows moved by {moved}"
        with pytest.raises(ValueError, match="reads 2 target layers"):
            drafter.lsa(stack_layer_kv(out.keys, out.values)[0])


def test_paged_twin_reads_the_same_layers():
    """What vLLM's tap runs on CPU (the twin over the selected layers' paged caches) equals the
    runtime's rows."""
    from vllm_moa.integration.shell import compat
    from vllm_moa.kernels import lsa_attention_reference, write_slots

    target = make_target("llama")
    drafter = make_drafter(target, 3)
    with torch.no_grad():
        out = target(torch.randint(0, 97, (1, 11)))
    slots = torch.randperm(6 * 32)[:11]
    caches = []
    for k, v in zip(out.keys, out.values):
        cache = torch.randn(6, 2, 32, 2 * 16)
        write_slots(cache, slots, k[0].transpose(0, 1), v[0].transpose(0, 1), layout=compat.cpu_vec_kv_layout)
        caches.append(cache)
    with torch.no_grad():
        got = lsa_attention_reference(drafter.lsa, drafter.lsa.select(caches), slots, layout=compat.cpu_vec_kv_layout)
        want = drafter.rows_from_kv(out.keys, out.values)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fingerprint_names_the_layers_read():
    """Client and server must agree on which layers make a row: the fingerprint differs by stride,
    and a drafter reading every layer keeps the fingerprint it had before strides existed."""
    target = make_target("llama")
    full, strided = make_drafter(target, 1), make_drafter(target, 2)
    strided.lsa.load_state_dict(full.lsa.state_dict())
    assert full.lsa_fingerprint() != strided.lsa_fingerprint()
