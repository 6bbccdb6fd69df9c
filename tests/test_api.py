"""The public surface: embedded model end to end, CLI, typed errors, import direction."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from onecall import LLM, SamplingParams
from onecall.cli import main
from onecall.config import EngineConfig
from onecall.errors import InvalidParameterError, ModelNotFoundError

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
# `llm`: the embedded SmolLM2-135M-Instruct (Q4_1 GGUF), float32 on CPU, loaded once per session
# (tests/conftest.py); the tests that run it are marked slow.


def test_the_cuda_dtype_follows_the_gpus_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 from compute capability 8.0 (Triton's bfloat16 dot needs it), float16 below; an
    explicit bfloat16 with the fast kernels on an older GPU is refused naming dtype (read from the
    capability alone: no GPU needed)."""
    import torch

    from onecall.config import check_device_dtype, default_dtype

    cuda = torch.device("cuda:0")
    for capability, want in (((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 5), torch.float16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert default_dtype(cuda) == want
        if want == torch.float16:
            with pytest.raises(InvalidParameterError) as e:
                check_device_dtype(cuda, torch.bfloat16, "fast")
            assert e.value.param == "dtype" and "7.5" in str(e.value)
            check_device_dtype(cuda, torch.bfloat16, "reference")  # torch's own ops take it
        else:
            check_device_dtype(cuda, torch.bfloat16, "fast")
    assert default_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.slow
def test_embedded_model_answers_paris(llm: LLM) -> None:
    out = llm.chat(PARIS, SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the template's <|im_end|> ends it cleanly
    t = out.trace
    control = [
        llm.tokenizer.decode([i], skip_special_tokens=False)
        for i, c in zip(t.prompt_token_ids, t.prompt_is_control)
        if c
    ]
    assert control == ["<|im_start|>", "<|im_end|>", "<|im_start|>", "<|im_end|>", "<|im_start|>"]


@pytest.mark.slow
def test_int8_activations_still_answer_and_say_so() -> None:
    """The embedded model with llama.cpp's activation rounding (int8 per group of 32): its every
    projection runs the int8-activation kernel, and it still answers."""
    with LLM(int8_activations=True, kv_cache_gib=0.05) as llm:
        assert "int8 activations" in llm.info.kernels and "native decode step" in llm.info.kernels
        out = llm.chat(PARIS, SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


@pytest.mark.slow
def test_second_turn_hits_prefix_cache(llm: LLM) -> None:
    first = llm.chat(PARIS, SamplingParams(temperature=0, max_tokens=32))[0]
    conv = PARIS + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = llm.chat(conv, SamplingParams(temperature=0, max_tokens=32))[0]
    # the whole first call (prompt + answer) is reused, token for token
    assert second.num_cached_tokens >= first.num_prompt_tokens + len(first.token_ids) - 2
    assert second.trace.num_prefilled_tokens == second.num_prompt_tokens - second.num_cached_tokens


@pytest.mark.slow
def test_streaming_deltas_add_up(llm: LLM) -> None:
    deltas = list(llm.chat_stream(PARIS, SamplingParams(temperature=0, max_tokens=32)))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.delta_text for d in deltas) == deltas[-1].text


@pytest.mark.slow
def test_generate_accepts_str_ids_and_batches(llm: LLM) -> None:
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.encode("The sky is")
    a, b = llm.generate(["The sky is", ids], p)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 4
    # alone (a batch of one) it gives the same tokens: batch invariance. Recomputed, not a prefix-cache
    # hit: a hit runs the prompt's last token alone through the one-query attention kernel, whose bits
    # can differ from the prefill chunk's (see README, "Batch invariance").
    llm.reset_prefix_cache()
    assert llm.generate(ids, p)[0].token_ids == a.token_ids


@pytest.mark.slow
def test_float16_kv_cache(llm: LLM) -> None:
    """kv_cache_dtype="float16" stores K/V in half precision (the native kernels read it directly):
    the cache is float16, and greedy answers agree with the float32 cache's on these prompts."""
    half = LLM(kv_cache_dtype="float16", kv_cache_gib=0.1)
    assert half.engine.parts.kv_cache.k.dtype is torch.float16
    p = SamplingParams(temperature=0, max_tokens=12)
    for messages in (PARIS, [{"role": "user", "content": "Name three colors."}]):
        assert half.chat(messages, p)[0].text == llm.chat(messages, p)[0].text


@pytest.mark.slow
def test_cli_run_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "What is the capital of France?", "--json", "--max-tokens", "24"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in doc["text"]
    assert doc["trace"]["num_prompt_tokens"] == len(doc["trace"]["prompt_token_ids"])
    assert doc["trace"]["finish_reason"] == "stop"


def test_cli_bad_model_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/model.gguf" in err and "Traceback" not in err


def test_unknown_model_path_raises_typed() -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        LLM(model="/nowhere/at/all")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {5: 500.0}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_sampling_params_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"dtype": "int3"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"device": "cuda:0"}, "device"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_cache_gib": -1.0}, "kv_cache_gib"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
        ({"cuda_graphs": "yes"}, "cuda_graphs"),
        ({"int8_activations": 1}, "int8_activations"),
        ({"int8_activations": True, "kernels": "reference"}, "int8_activations"),
        ({"state_snapshots": -1}, "state_snapshots"),
    ],
)
def test_engine_config_names_the_parameter(kwargs: dict, param: str) -> None:
    if param == "device":
        pytest.importorskip("torch")
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
    with pytest.raises(InvalidParameterError) as e:
        EngineConfig(**kwargs)
    assert e.value.param == param


@pytest.mark.slow
def test_model_package_never_imports_engine_text_or_server() -> None:
    code = (
        "import sys, onecall.model.decoder, onecall.formats.checkpoint;"
        "bad=[m for m in sys.modules if m.startswith(('onecall.engine','onecall.text','onecall.server','fastapi'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_text_package_never_imports_torch() -> None:
    code = "import sys, onecall.text.chat_template, onecall.text.tokenizer; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow
def test_bad_prompt_in_a_batch_leaves_nothing_behind(llm: LLM) -> None:
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks + engine.block_manager.num_evictable_blocks
    with pytest.raises(InvalidParameterError, match="prompt"):
        llm.generate(["fine", "also fine", []], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()  # the two good prompts were withdrawn too
    assert engine.block_manager.num_free_blocks + engine.block_manager.num_evictable_blocks == free_before
    out = llm.generate("next call", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out) == 1 and len(out[0].token_ids) == 3
