"""The one-pass decoder (answers + hidden states) against transformers itself."""

from __future__ import annotations

import pytest
import torch

from dynamo_spec.training.decode import BatchDecoder

pytestmark = pytest.mark.unit

AUX = (1, 3, 4)


@pytest.fixture(scope="module")
def toy_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=6, vocab_size=100,
                      max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def reference(model, prompt: list[int], n: int, eos: set[int]):
    """Greedy one sequence at a time with transformers, then its hidden states."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in eos:
                break
        hs = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in AUX], dim=-1)[0]
    return ids[len(prompt):], aux, hs[-1][0]


def test_batched_decoding_with_refills_matches_transformers(toy_llama):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 17, 9, 2, 30, 11)]
    first = reference(toy_llama, prompts[0], 1, set())[0][0]
    eos = {first}  # prompt 0 stops after one token; the others run to the cap
    decoder = BatchDecoder(toy_llama, AUX)
    # 3 slots for 6 prompts: finished slots are refilled while others are mid-answer
    got = decoder.generate(prompts, max_new_tokens=12, eos_ids=eos, batch_size=3)
    for prompt, (answer, aux, final) in zip(prompts, got):
        ref_answer, ref_aux, ref_final = reference(toy_llama, prompt, 12, eos)
        assert answer == ref_answer
        assert aux.shape == (len(prompt) + len(answer), 3 * 32)
        torch.testing.assert_close(aux, ref_aux, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, ref_final, atol=1e-4, rtol=1e-4)
    assert len(got[0][0]) == 1 and got[0][0][0] == first
    assert all(len(a) == 12 for a, _, _ in got[1:] if first not in a)


def test_stream_stops_starting_prompts_after_the_deadline(toy_llama):
    prompts = [[5, 6, 7]] * 5
    decoder = BatchDecoder(toy_llama, AUX)
    done = list(decoder.stream(prompts, 4, set(), batch_size=2, stop_at=0.0))
    assert done == []  # the deadline had passed before the first prompt was started


def test_sampled_answers_follow_their_seed_not_the_batching(toy_llama):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (4, 9, 6, 13)]
    decoder = BatchDecoder(toy_llama, AUX)
    sampling = {1: (1.0, 11), 3: (1.0, 12)}  # prompts 0 and 2 stay greedy
    alone = decoder.generate(prompts, 10, set(), batch_size=1, sampling=sampling)
    batched = decoder.generate(prompts, 10, set(), batch_size=4, sampling=sampling)
    assert [a for a, _, _ in alone] == [a for a, _, _ in batched]
    for q in (0, 2):  # greedy rows are transformers' greedy answers
        assert alone[q][0] == reference(toy_llama, prompts[q], 10, set())[0]
    other_seed = decoder.generate(prompts, 10, set(), batch_size=4,
                                  sampling={1: (1.0, 99), 3: (1.0, 98)})
    greedy = decoder.generate(prompts, 10, set(), batch_size=4)
    # a random toy model's next-token distribution is wide: samples differ from the
    # greedy path and between seeds
    assert batched[1][0] != greedy[1][0] and batched[3][0] != greedy[3][0]
    assert (batched[1][0], batched[3][0]) != (other_seed[1][0], other_seed[3][0])
    # the states are still the target's own over the sampled sequence
    ref_aux = reference(toy_llama, prompts[1] + batched[1][0], 0, set())[1]
    torch.testing.assert_close(batched[1][1], ref_aux, atol=1e-4, rtol=1e-4)
