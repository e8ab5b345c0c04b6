"""The official `openai` client against `host serve`: completions and chat, streamed and not,
errors as the client raises them, then a bounded load test (64 requests, 16 at a time) in which
every greedy request must equal its single run. Prints the load test's figures as JSON.

    python openai_client.py --base-url http://127.0.0.1:8080/v1 --model kjv-gemma4
"""

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import openai

OPENINGS = [
    "In the beginning", "And it came to pass", "The word of the LORD came", "Now it came to pass, when",
    "And Abraham said", "Blessed is the man", "And God said", "Hear, O Israel",
    "The LORD is my shepherd", "And Moses spake unto", "Then answered Jesus", "And the king said",
    "Praise ye the LORD", "And they departed", "Thus saith the LORD", "And when the people saw",
]


def check_api(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="In the beginning", max_tokens=16, temperature=0)
    text = whole.choices[0].text
    assert text and whole.usage.completion_tokens <= 16, whole
    assert whole.choices[0].finish_reason in ("length", "stop"), whole
    chunks = list(client.completions.create(model=model, prompt="In the beginning", max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Who made the heaven and the earth?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=16, temperature=0)
    answer = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and answer, chat
    streamed = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=16,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer

    # Penalties and a logit bias, as the client sends them: they change the text, and the
    # streamed text equals the whole one.
    controls = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {"5": -100},
                "extra_body": {"repetition_penalty": 1.3, "repetition_context_size": 16}}
    penalized = client.completions.create(model=model, prompt="In the beginning", max_tokens=16, temperature=0,
                                          **controls)
    assert penalized.choices[0].text != text, penalized
    chunks = client.completions.create(model=model, prompt="In the beginning", max_tokens=16, temperature=0,
                                       stream=True, **controls)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == penalized.choices[0].text
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=16, temperature=0,
                                          **controls)
    assert chat.choices[0].message.content != answer, chat

    # Log-probabilities: completions' lists and chat's content entries, greedy's the most likely.
    scored = client.completions.create(model=model, prompt="In the beginning", max_tokens=8, temperature=0, logprobs=2)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8, lp
    assert all(max(top.values()) == value for top, value in zip(lp.top_logprobs, lp.token_logprobs)), lp
    scored_chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=8,
                                                 temperature=0, logprobs=True, top_logprobs=3)
    content = scored_chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 3 for c in content), content
    assert all(c.top_logprobs[0].logprob == c.logprob and c.bytes == list(c.token.encode()) for c in content), content

    # n choices: choice i is sampled with seed + i, as a request of that seed alone.
    two = client.completions.create(model=model, prompt="In the beginning", max_tokens=16, temperature=0.8, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1], two
    alone = client.completions.create(model=model, prompt="In the beginning", max_tokens=16, temperature=0.8, seed=8)
    assert two.choices[1].text == alone.choices[0].text, (two, alone)
    chat_two = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=16,
                                              temperature=0.8, seed=7, n=2)
    assert len(chat_two.choices) == 2 and all(c.message.content for c in chat_two.choices), chat_two

    bad_controls = [({"temperature": 5}, "temperature"), ({"n": 17}, "n"), ({"frequency_penalty": 3}, "frequency_penalty"),
                    ({"logit_bias": {"999999": 1}}, "logit_bias")]
    for bad, field in bad_controls:
        try:
            client.completions.create(model=model, prompt="x", max_tokens=4, **bad)
        except openai.UnprocessableEntityError as e:
            assert field in str(e), e
        else:
            raise AssertionError(f"{bad} was accepted")
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    except openai.NotFoundError as e:
        assert model in str(e), e
    else:
        raise AssertionError("an unknown model was accepted")


def streamed_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int):
    """(text, completion tokens, seconds to first text)."""
    start = time.perf_counter()
    first, pieces, tokens = None, [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.perf_counter() - start
            pieces.append(chunk.choices[0].text)
    return "".join(pieces), tokens, first


def load_test(client: openai.OpenAI, model: str, requests: int, concurrency: int, max_tokens: int) -> dict:
    alone = {p: client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0)
             .choices[0].text for p in OPENINGS}
    prompts = [OPENINGS[i % len(OPENINGS)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: streamed_request(client, model, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    assert len(results) == requests
    for i, (prompt, (text, _, _)) in enumerate(zip(prompts, results)):
        assert text == alone[prompt], f"request {i} ({prompt!r}): {text!r} != alone {alone[prompt]!r}"
    ttft = sorted(r[2] for r in results if r[2] is not None)
    tokens = sum(r[1] for r in results)
    return {
        "requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
        "completion_tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1e3 * statistics.median(ttft), 1),
        "ttft_p99_ms": round(1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    check_api(client, args.model)
    print(json.dumps(load_test(client, args.model, args.requests, args.concurrency, args.max_tokens)))


if __name__ == "__main__":
    main()
