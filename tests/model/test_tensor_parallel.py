"""Tensor parallelism at the model level (model/parallel.py): two gloo ranks on CPU give the logits of
one unsplit model.

Each rank builds its slice of a tiny random-weight model (shard_config), loads the checkpoint's
tensors through shard_weights, keeps its own KV heads in its own paged cache, and runs a prefill and
three greedy decode steps; rank 0's gathered logits are compared with the same model run whole in
this process. Tolerance: 1e-5 absolute on logits of magnitude ~1: the two all-reduces per layer sum
partial matmuls in another order than one matmul does (float32). Greedy tokens must be equal.

What is exercised: row/column splits with biases (q/k/v bias on every rank, o_proj's bias once),
Qwen3's replicated q/k norms, tied and untied embeddings, and a vocabulary (97) that does not divide
by 2 (the last rank's padding rows never reach the logits). Loading: a rank reads only its part of
each split tensor from safetensors (get_slice), and gets what slicing the whole tensors gives.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from onecall.engine.engine_parts import shard_weights
from onecall.errors import UnsupportedModelError
from onecall.formats.hf_config import model_config_from_hf
from onecall.loading.weights import load_weights
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from onecall.model.parallel import TensorParallel
from tests.helpers.make_models import random_state_dict, tiny_hf_config

pytestmark = pytest.mark.slow  # two spawned processes per case

CASES = {
    "llama": dict(attention_bias=True, vocab_size=97),  # o_proj bias; vocabulary padded on rank 1
    "qwen2": {},  # q/k/v biases, tied embeddings
    "qwen3": {},  # q/k norms, head_dim != hidden / heads
    "phi3": {},  # fused qkv_proj / gate_up_proj in the checkpoint, split before sharding
}
PROMPT = [5, 17, 33, 2, 90, 7, 11]
BLOCK, NUM_BLOCKS = 4, 8


def _run(arch: str, tp: TensorParallel | None) -> torch.Tensor:
    """Prefill PROMPT, then 3 greedy steps: the 4 positions' logits, (4, vocab_size)."""
    hf, state = _checkpoint(arch)
    config = model_config_from_hf(hf)
    model = DecoderLM(config, tp=tp)
    weights = iter(state.items())
    load_weights(model, weights if tp is None else shard_weights(tp, weights, config))
    local = model.config  # this rank's heads
    cache = PagedKVCache(
        local.num_hidden_layers,
        NUM_BLOCKS,
        BLOCK,
        local.num_key_value_heads,
        local.head_dim,
        torch.float32,
        "cpu",
    )
    table = [list(range(NUM_BLOCKS))]
    n = len(PROMPT)
    with torch.inference_mode():
        meta = build_attention_metadata(table, [n], [n], BLOCK, "cpu", backend="reference")
        hidden = model(torch.tensor(PROMPT), torch.arange(n), cache, meta)
        logits = [model.compute_logits(hidden[-1:])]
        for _ in range(3):
            n += 1
            token = logits[-1].argmax(dim=-1)
            meta = build_attention_metadata(table, [n], [1], BLOCK, "cpu", backend="reference")
            logits.append(model.compute_logits(model(token, torch.tensor([n - 1]), cache, meta)))
    return torch.cat(logits)


def _checkpoint(arch: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json dict and state dict; phi3: llama-shaped weights stored fused, as Phi-3 stores them."""
    if arch != "phi3":
        hf = tiny_hf_config(arch, **CASES[arch])
        return hf, random_state_dict(hf, seed=3)
    hf = tiny_hf_config("llama") | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    state = random_state_dict(tiny_hf_config("llama"), seed=3)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        parts = [state.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        state[p + "self_attn.qkv_proj.weight"] = torch.cat(parts)
        gate, up = state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")
        state[p + "mlp.gate_up_proj.weight"] = torch.cat((gate, up))
    return hf, state


def _rank_main(rank: int, world_size: int, port: int, arch: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        logits = _run(arch, TensorParallel(rank, world_size))
        if rank == 0:
            save_file({"logits": logits.contiguous()}, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("arch", list(CASES))
def test_two_ranks_give_the_whole_models_logits(arch: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    want = _run(arch, None)
    out = tmp_path / "rank0.safetensors"
    mp.start_processes(_rank_main, args=(2, _free_port(), arch, str(out)), nprocs=2, start_method="spawn")
    got = load_file(out)["logits"]
    assert got.shape == want.shape == (4, CASES[arch].get("vocab_size", 96))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_size_that_does_not_divide_the_heads_is_refused_by_name() -> None:
    """The embedded SmolLM2 (9 query heads, 3 KV heads) cannot be split in 2."""
    smollm2 = model_config_from_hf(
        tiny_hf_config("llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       intermediate_size=1536)
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(9\), num_key_value_heads \(3\)"):
        TensorParallel(0, 2).shard_config(smollm2)
    TensorParallel(0, 3).check_divides(smollm2)  # 3 does: no error


def test_each_rank_holds_its_slice() -> None:
    hf = tiny_hf_config("llama", attention_bias=True, vocab_size=97)
    config = model_config_from_hf(hf)
    state = random_state_dict(hf, seed=1)
    q = state["model.layers.0.self_attn.q_proj.weight"]  # (4 heads * 8, 32)
    o_bias = state["model.layers.0.self_attn.o_proj.bias"]
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        got = dict(shard_weights(tp, iter(state.items()), config))
        assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], q[rank * 16 : (rank + 1) * 16])
        down = state["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], down[:, rank * 32 : (rank + 1) * 32])
        assert torch.equal(got["model.layers.0.self_attn.o_proj.bias"], o_bias if rank == 0 else 0 * o_bias)
        embed = got["model.embed_tokens.weight"]
        assert embed.shape == (49, 32)  # ceil(97 / 2) rows on both ranks
        assert torch.equal(embed[: 97 - 49 * rank], state["model.embed_tokens.weight"][49 * rank :][:49])
    assert tp.shard_config(config).num_attention_heads == 2


@pytest.mark.parametrize("arch", list(CASES))
def test_each_rank_reads_only_its_slice_from_safetensors(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine_parts.iter_rank_weights gives what shard_weights gives over the whole tensors, and reads
    every split tensor through get_slice: get_tensor only for replicated ones and fused projections."""
    from onecall.engine import engine_parts
    from onecall.formats.checkpoint import resolve_model
    from onecall.model.parallel import is_fused
    from tests.helpers.make_models import write_tiny_hf_folder

    hf, state = _checkpoint(arch)
    files = resolve_model(str(write_tiny_hf_folder(tmp_path / arch, state, hf, shards=2)))
    config = model_config_from_hf(hf)
    whole: list[str] = []
    real_open = engine_parts.safe_open

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = real_open(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.file.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            whole.append(name)
            return self.file.get_tensor(name)

        def get_slice(self, name: str) -> Any:
            return self.file.get_slice(name)

    monkeypatch.setattr(engine_parts, "safe_open", Recording)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        whole.clear()
        got = dict(engine_parts.iter_rank_weights(files, torch.float32, tp, config))
        want = dict(shard_weights(tp, iter(state.items()), config))
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (rank, name)
        assert whole and all(is_fused(n) or tp.shard_slice(n, config) is None for n in whole), whole
        assert any(tp.shard_slice(n, config) is not None for n in got)  # some tensors were split
