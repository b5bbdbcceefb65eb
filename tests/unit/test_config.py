import pytest

from afd_cupy.config import ConnectorConfig, ModelConfig, TopologyConfig
from afd_cupy.errors import ConfigError

MODEL = dict(hidden_size=64, num_experts=8, top_k=2, moe_intermediate_size=32)


def test_connector_defaults_and_ring_depth_follows_stages():
    assert ConnectorConfig().ring_depth == 1
    cfg = ConnectorConfig(async_moe_ubatching=True, async_moe_num_ubatches=3)
    assert cfg.num_stages == 3 and cfg.ring_depth == 3
    assert ConnectorConfig(ring_depth=4).ring_depth == 4


def test_connector_from_mapping_exact_rfc_fields():
    fields = dict(attn_ranks_per_dp=1, ring_depth=2, routed_cap_multiplier=1.5,
                  recv_poll_timeout_ms=50, async_moe_ubatching=True, async_moe_num_ubatches=2,
                  async_moe_split="even")
    cfg = ConnectorConfig.from_mapping(fields)
    assert cfg.routed_cap_multiplier == 1.5 and cfg.ring_depth == 2


def test_unknown_keys_listed_sorted():
    with pytest.raises(ConfigError, match=r"unknown ConnectorConfig keys: \['alpha', 'zeta'\]"):
        ConnectorConfig.from_mapping({"zeta": 1, "alpha": 2, "ring_depth": 1})
    with pytest.raises(ConfigError, match=r"unknown ModelConfig keys: \['hidden'\]"):
        ModelConfig.from_mapping({**MODEL, "hidden": 3})


@pytest.mark.parametrize("key,value,pattern", [
    ("ring_depth", True, r"ring_depth must be an int, got bool True"),
    ("recv_poll_timeout_ms", 0, r"recv_poll_timeout_ms must be >= 1, got 0"),
    ("attn_ranks_per_dp", -2, r"attn_ranks_per_dp must be >= 1, got -2"),
    ("routed_cap_multiplier", 0.0, r"routed_cap_multiplier must be a finite number > 0, got 0.0"),
    ("routed_cap_multiplier", -1, r"got -1"),
    ("routed_cap_multiplier", True, r"must be a number, got bool"),
    ("async_moe_ubatching", 1, r"async_moe_ubatching must be a bool, got int 1"),
    ("async_moe_num_ubatches", 2.0, r"must be an int, got float 2.0"),
    ("async_moe_split", "odd", r"async_moe_split must be one of \('even',\), got 'odd'"),
    ("wire_mode", "both", r"wire_mode must be one of \('pair', 'dedup'\), got 'both'"),
])
def test_connector_rejects(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ConnectorConfig.from_mapping({key: value})


def test_wire_mode_default_and_from_mapping():
    assert ConnectorConfig().wire_mode == "pair"
    assert ConnectorConfig.from_mapping({"wire_mode": "dedup"}).wire_mode == "dedup"


def test_ring_depth_below_stages():
    with pytest.raises(ConfigError, match=r"ring_depth=1 < number of stages 2"):
        ConnectorConfig(ring_depth=1, async_moe_ubatching=True, async_moe_num_ubatches=2)


@pytest.mark.parametrize("key,value,pattern", [
    ("hidden_size", 0, r"hidden_size must be >= 1, got 0"),
    ("num_experts", True, r"num_experts must be an int, got bool"),
    ("top_k", 9, r"top_k=9 > num_experts=8"),
    ("num_shared_experts", -1, r"num_shared_experts must be >= 0, got -1"),
    ("dtype", "int8", r"dtype must be one of .*got 'int8'"),
    ("routed_scaling_factor", 0, r"routed_scaling_factor must be a finite number > 0, got 0"),
    ("scoring_func", "relu", r"scoring_func must be one of"),
    ("max_num_batched_tokens", 1.5, r"max_num_batched_tokens must be an int, got float 1.5"),
])
def test_model_rejects(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_mapping({**MODEL, key: value})


def test_model_groups():
    assert ModelConfig(**MODEL, n_group=4, topk_group=2).n_group == 4
    with pytest.raises(ConfigError, match="go together"):
        ModelConfig(**MODEL, n_group=4)
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible by n_group=3"):
        ModelConfig(**MODEL, n_group=3, topk_group=1)
    with pytest.raises(ConfigError, match=r"topk_group=5 > n_group=4"):
        ModelConfig(**MODEL, n_group=4, topk_group=5)


def test_model_itemsize_and_frozen():
    cfg = ModelConfig(**MODEL, dtype="float32")
    assert cfg.itemsize == 4 and ModelConfig(**MODEL).itemsize == 2
    with pytest.raises(AttributeError):
        cfg.hidden_size = 3


def test_topology_config():
    assert TopologyConfig.from_mapping({"num_attn_ranks": 3, "num_ffn_ranks": 2}).num_attn_ranks == 3
    with pytest.raises(ConfigError, match=r"num_ffn_ranks must be >= 1, got 0"):
        TopologyConfig(1, 0)
    with pytest.raises(ConfigError, match=r"unknown TopologyConfig keys: \['gpus'\]"):
        TopologyConfig.from_mapping({"num_attn_ranks": 1, "num_ffn_ranks": 1, "gpus": 2})


@pytest.mark.parametrize("bad", [-1, 1.5, True, "500"])
def test_connector_recv_spin_us_is_checked_before_any_collective_step(bad):
    from afd_cupy.connector import AFDConnector

    model = ModelConfig(hidden_size=64, num_experts=4, top_k=2, moe_intermediate_size=32)
    with pytest.raises(ConfigError, match=rf"recv_spin_us must be an int >= 0 \(microseconds\), got {bad!r}"):
        AFDConnector(model, TopologyConfig(1, 1), role="ffn", role_rank=0, store=None, recv_spin_us=bad)


def test_from_mapping_names_the_missing_required_keys():
    partial = {k: v for k, v in MODEL.items() if k not in ("top_k", "hidden_size")}
    with pytest.raises(ConfigError, match=r"ModelConfig keys missing: \['hidden_size', 'top_k'\]"):
        ModelConfig.from_mapping(partial)
    with pytest.raises(ConfigError, match=r"TopologyConfig keys missing: \['num_ffn_ranks'\]"):
        TopologyConfig.from_mapping({"num_attn_ranks": 1})


@pytest.mark.parametrize("value", [1e308, 1e6])
def test_a_huge_routed_cap_multiplier_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"routed_cap_multiplier must be <= 65536"):
        ConnectorConfig.from_mapping({"routed_cap_multiplier": value})
    ConnectorConfig(routed_cap_multiplier=8.0)  # any FFN count is fine


@pytest.mark.parametrize("bad", [1.0, "1", None])
def test_a_role_rank_that_is_not_an_int_says_so(bad):
    from afd_cupy.runtime.topology import Role, Topology

    with pytest.raises(ConfigError, match=rf"attention role rank must be an int, got \w+ {bad!r}"):
        Topology(2, 1, 4).world_rank(Role.ATTENTION, bad)


def test_rank_local_knobs_are_left_out_of_the_handshake_record():
    from afd_cupy.config import RANK_LOCAL_FIELDS
    from afd_cupy.runtime.handshake import config_record

    model, topology = ModelConfig(**MODEL), TopologyConfig(1, 1)
    mine = config_record(model, topology, ConnectorConfig(), backend="host")
    theirs = config_record(model, topology, ConnectorConfig(recv_poll_timeout_ms=7, fused_dispatch=False),
                           backend="host")
    assert mine == theirs and set(RANK_LOCAL_FIELDS) == {"recv_poll_timeout_ms", "fused_dispatch",
                                                     "dedup_dispatch"}
    assert "connector.wire_mode" in mine and "connector.routed_cap_multiplier" in mine
