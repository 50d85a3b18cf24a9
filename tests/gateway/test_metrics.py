"""Gateway-measured latencies and the attention service's GetStats as Prometheus text."""
from prometheus_client.parser import text_string_to_metric_families

from splitmoe.gateway.attention_types import AttentionStats, ExpertHeat, ExpertTokens, HopStats
from splitmoe.gateway.metrics import GatewayMetrics


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_timer_observes_ttft_itl_and_e2e_with_vllm_names():
    metrics = GatewayMetrics()
    clock = iter([0.0, 0.5, 0.6, 0.7, 0.9, 1.0]).__next__
    timer = metrics.request_timer(clock)      # arrival at 0.0
    timer.on_message(0, 1)                    # first message at 0.5: TTFT
    timer.on_message(1, 1)                    # another choice's first message: neither TTFT nor ITL
    timer.on_message(0, 1)                    # 0.2 after choice 0's last
    timer.on_message(0, 2)                    # two tokens in one message: two gaps of 0.1
    timer.finish(10, 4, ["stop", "length"])   # at 1.0
    s = samples(metrics.render(None))
    assert s[("splitmoe:time_to_first_token_seconds_sum", ())] == 0.5
    assert s[("splitmoe:inter_token_latency_seconds_count", ())] == 3
    assert abs(s[("splitmoe:inter_token_latency_seconds_sum", ())] - 0.4) < 1e-9
    assert s[("splitmoe:e2e_request_latency_seconds_sum", ())] == 1.0
    assert s[("splitmoe:prompt_tokens_total", ())] == 10
    assert s[("splitmoe:generation_tokens_total", ())] == 4
    assert s[("splitmoe:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("splitmoe:attention_service_up", ())] == 0


def test_stats_become_gauges_and_counters_at_scrape():
    stats = AttentionStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, max_batch_seqs_seen=7, num_steps=9,
                           prefix_cache_queries=1000, prefix_cache_hits=750,
                           hops=(HopStats(address="10.0.0.1:9000", num_hops=48, hop_s_total=0.5, compute_s_total=0.3,
                                          bytes_total=4096, healthy=False),),
                           expert_tokens=(ExpertTokens(layer=1, expert=5, tokens=12),))
    s = samples(GatewayMetrics().render(stats))
    assert s[("splitmoe:num_requests_running", ())] == 3
    assert s[("splitmoe:num_requests_waiting", ())] == 2
    assert s[("splitmoe:kv_cache_usage_perc", ())] == 0.25
    assert s[("splitmoe:max_batch_seqs", ())] == 7
    assert s[("splitmoe:prefix_cache_queries_total", ())] == 1000
    assert s[("splitmoe:prefix_cache_hits_total", ())] == 750
    addr = (("address", "10.0.0.1:9000"),)
    assert s[("splitmoe:expert_hops_total", addr)] == 48
    assert s[("splitmoe:expert_hop_seconds_total", addr)] == 0.5
    assert s[("splitmoe:expert_hop_bytes_total", addr)] == 4096
    assert s[("splitmoe:expert_service_healthy", addr)] == 0
    assert s[("splitmoe:expert_tokens_total", (("expert", "5"), ("layer", "1")))] == 12
    assert s[("splitmoe:attention_service_up", ())] == 1


def test_speculative_decoding_counters_carry_vllms_names():
    stats = AttentionStats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=25,
                           spec_accepted_per_position=(9, 7, 5, 4))
    s = samples(GatewayMetrics().render(stats))
    assert s[("splitmoe:spec_decode_num_drafts_total", ())] == 10
    assert s[("splitmoe:spec_decode_num_draft_tokens_total", ())] == 40
    assert s[("splitmoe:spec_decode_num_accepted_tokens_total", ())] == 25
    assert [s[("splitmoe:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))]
            for p in range(4)] == [9, 7, 5, 4]


def test_heat_placement_and_imbalance_become_gauges():
    stats = AttentionStats(expert_imbalance=1.75, expert_heat=(
        ExpertHeat(layer=0, expert=3, tokens=40, tokens_per_s=12.5, placed_on=("a:1", "b:2")),
        ExpertHeat(layer=1, expert=0, tokens=9, tokens_per_s=0.5, placed_on=("local",))))
    s = samples(GatewayMetrics().render(stats))
    assert s[("splitmoe:expert_heat_tokens_per_second", (("expert", "3"), ("layer", "0")))] == 12.5
    assert s[("splitmoe:expert_replicas", (("expert", "3"), ("layer", "0")))] == 2
    assert s[("splitmoe:expert_replicas", (("expert", "0"), ("layer", "1")))] == 0  # computed by attention
    assert s[("splitmoe:expert_imbalance", ())] == 1.75


def test_two_apps_do_not_share_a_registry():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.prompt_tokens.inc(5)
    assert samples(b.render(None))[("splitmoe:prompt_tokens_total", ())] == 0
