"""The Edge-size device benchmark's arithmetic and timing on a tiny model (on CPU; `.ci/device` runs it at
Edge size on a GPU)."""

import dataclasses
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from policy_server.benchmarks.edge_tick import edge_config, gen_call_flops, measure
from policy_server.benchmarks.forward import embedded_like_config, policy_step_kwargs, random_model


@pytest.mark.parametrize("activation", ["silu", "relu2"])  # SwiGLU's three MLP matrices, Edge's two
def test_the_matmul_flops_of_a_gen_call_are_torchs_count(activation):
    config = dataclasses.replace(embedded_like_config(), hidden_act=activation)
    model = random_model(config)
    kwargs = policy_step_kwargs(config, 40, (16, 3, 8, 8), 8)
    und_len = kwargs["und_len"]
    with torch.inference_mode():
        und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, :und_len])
        gen = model.embed_gen(**kwargs, layout=model.gen_layout(**kwargs))
        with FlopCounterMode(display=False) as counter:
            model.gen_stack(gen, und_kv)
    matmul, _ = gen_call_flops(config, kwargs["sequence_length"] - und_len, und_len)
    assert matmul == counter.get_total_flops()  # torch's counter leaves the CPU attention kernel out


def test_edge_shapes_and_a_timed_tick_on_a_tiny_model():
    edge = edge_config()
    assert (edge.num_hidden_layers, edge.hidden_size, edge.intermediate_size, edge.nemotron_backbone) == \
        (28, 2048, 9216, True)
    result = measure(embedded_like_config(), torch.device("cpu"), torch.float32, 40, (16, 3, 8, 8), 8, repeats=2)
    assert result["gen_tokens"] == 3 * 4 * 4 + 8 and result["text_tokens"] == 40
    assert all(result[key] > 0 for key in ("prefill_ms", "gen_call_ms", "cfg_pair_call_ms"))
    json.dumps(result)
