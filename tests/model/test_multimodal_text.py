"""A multimodal checkpoint's language model alone: Gemma3ForConditionalGeneration (Gemma 3 4B/12B/27B
on the hub) loads as its Gemma 3 text model (formats/hf_config.py text_model_config; the weights'
`language_model.` prefixes renamed and the vision tower skipped, formats/checkpoint.py
language_model_tensor).

Oracle: transformers' own Gemma3ForConditionalGeneration on text-only input ids, a tiny random one
(a 1-layer vision tower beside a 2-layer language model, one sliding and one global layer), saved with
save_pretrained as a user's folder is. Greedy tokens must be equal and the first step's top logprobs
within 1e-4 (float32, summation order only), on the reference and the fast kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from onecall import LLM, SamplingParams
from onecall.errors import UnsupportedModelError
from onecall.formats.checkpoint import language_model_tensor
from tests.helpers.family_checks import write_word_level_tokenizer

VOCAB = 300
PROMPT = [5, 9, 17, 33, 2, 8, 100, 7, 9, 11, 12, 13]


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Gemma3ForConditionalGeneration]:
    text = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" not in name:
                p.normal_(0.0, 0.2)  # wide logit gaps: greedy is not decided by summation order
    folder = tmp_path_factory.mktemp("gemma3-mm")
    model.save_pretrained(folder)
    write_word_level_tokenizer(folder, VOCAB)
    return folder, model


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_language_model_of_a_multimodal_gemma3_matches_transformers(
    gemma3_folder: tuple[Path, Gemma3ForConditionalGeneration], kernels: str
) -> None:
    folder, hf = gemma3_folder
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[
            0, len(PROMPT) :
        ].tolist()
        first = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    with LLM(model=str(folder), kernels=kernels, kv_cache_gib=0.01, num_threads=1) as llm:
        assert llm.engine.model_config.architecture == "gemma3"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
        out = llm.generate([PROMPT], params)[0]
    assert list(out.token_ids) == want
    for token, logprob in out.top_logprobs[0]:
        assert abs(logprob - float(first[token])) < 1e-4, (token, logprob, float(first[token]))


def test_tensor_names() -> None:
    assert (
        language_model_tensor("language_model.model.layers.0.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert language_model_tensor("model.language_model.norm.weight") == "model.norm.weight"
    assert language_model_tensor("language_model.lm_head.weight") == "lm_head.weight"
    assert language_model_tensor("vision_tower.encoder.layers.0.mlp.fc1.weight") is None
    assert language_model_tensor("multi_modal_projector.mm_input_projection_weight") is None
    with pytest.raises(UnsupportedModelError, match="audio_tower"):
        language_model_tensor("audio_tower.layers.0.weight")  # nothing is dropped unseen
