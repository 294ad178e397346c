"""Speculative decoding through the service: the shared real-model router's decode rank
drafts (n-gram); greedy answers to copy-heavy chat prompts are transformers' argmax at
every position (teacher forced), drafts get accepted, and the counters reach
ClusterState, Prometheus and `pdserve status`."""

from __future__ import annotations

import urllib.request

PARAGRAPH = ("Packing boxes with five dozen liquor jugs is hard work, said the manager, who "
             "had been at the warehouse since early morning and wanted to go home.")
ASKS = [f"Repeat this sentence exactly: {PARAGRAPH}",
        "Rewrite this code with better names:\ndef f(a, b):\n    c = a + b\n    return c\n"]


def test_drafted_answers_are_the_models_greedy_answers(real_router, real_greedy_check,
                                                       real_model_path):
    from pdserve.engine.model.tokenizer import Tokenizer
    from pdserve.router.chat_template import ChatTemplate
    from pdserve.router.client import Client

    template = ChatTemplate.from_model_dir(real_model_path)
    tokenizer = Tokenizer.from_model(real_model_path)
    before = _accepted(real_router)
    with Client(real_router.address, timeout=120) as client:
        for ask in ASKS:
            prompt = template.encode(tokenizer, template.render([{"role": "user",
                                                                   "content": ask}]))
            out = client.generate(prompt, max_tokens=48, temperature=0, ignore_eos=True)
            assert len(out.token_ids) == 48
            real_greedy_check(prompt, out.token_ids)
        state = client.cluster_state()
    ranks = [r for p in state.pools if p.name == "decode" for r in p.ranks]
    assert sum(r.spec_accepted_tokens for r in ranks) > before
    assert all(sum(r.spec_accepted_per_pos) == r.spec_accepted_tokens for r in ranks)
    assert all(r.spec_accepted_tokens <= r.spec_draft_tokens for r in ranks)
    port = real_router.server.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "pdserve_rank_spec_decode_accepted_tokens_total" in text
    assert 'pdserve_rank_spec_decode_accepted_tokens_per_pos_total{pool="decode"' in text


def _accepted(router) -> int:
    return sum(r["spec_accepted_tokens"] for r in router.stats()["decode"])
