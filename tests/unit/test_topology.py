import pytest

from afd_cupy.errors import TopologyError
from afd_cupy.runtime.topology import Role, Topology


@pytest.mark.parametrize("num_attn,num_ffn", [(1, 1), (2, 2), (3, 2), (1, 4), (4, 1)])
def test_world_ranks_attention_first(num_attn, num_ffn):
    topo = Topology(num_attn, num_ffn, 16)
    assert topo.world_size == num_attn + num_ffn
    assert topo.num_regions == max(num_attn, num_ffn)
    seen = []
    for role, size in ((Role.ATTENTION, num_attn), (Role.FFN, num_ffn)):
        for r in range(size):
            w = topo.world_rank(role, r)
            assert topo.role_of(w) == (role, r)
            seen.append(w)
    assert seen == list(range(topo.world_size))
    assert topo.world_rank(Role.FFN, 0) == num_attn


def test_expert_ownership_padded_tail():
    topo = Topology(1, 3, 10)  # epr = 4: [0,4) [4,8) [8,10)+2 padding
    assert topo.expert_per_rank == 4
    assert [topo.owned_experts(r) for r in range(3)] == [range(0, 4), range(4, 8), range(8, 10)]
    assert [topo.expert_owner(e) for e in range(10)] == [0] * 4 + [1] * 4 + [2] * 2
    with pytest.raises(TopologyError, match=r"expert 10 out of range \[0, 10\)"):
        topo.expert_owner(10)


def test_impossible_topologies():
    with pytest.raises(TopologyError, match=r"FFN rank 3 would own no real expert"):
        Topology(1, 4, 5)  # epr 2 -> rank 3 starts at 6
    with pytest.raises(TopologyError, match=r"num_ffn_ranks must be an int >= 1, got 0"):
        Topology(1, 0, 4)
    with pytest.raises(TopologyError, match=r"num_attn_ranks must be an int >= 1, got True"):
        Topology(True, 1, 4)
    topo = Topology(2, 2, 4)
    with pytest.raises(TopologyError, match=r"ffn role rank 2 out of range \[0, 2\)"):
        topo.world_rank(Role.FFN, 2)
    with pytest.raises(TopologyError, match=r"world rank 4 out of range"):
        topo.role_of(4)


def test_role_opposite():
    assert Role.ATTENTION.opposite is Role.FFN and Role("ffn").opposite is Role.ATTENTION
