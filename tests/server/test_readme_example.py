"""The README's first request, sent as written to ``ksana serve --model smollm2`` (what ``make serve`` runs): with
no sampling parameters it gets SmolLM2's recommended settings from its generation config, and a sensible answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

from tests.server.conftest import ServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_request() -> tuple[str, dict]:
    """The route and JSON body of the README's first ``curl`` example."""
    command = re.search(r"```bash\n(curl .*?)```", README.read_text(), re.DOTALL).group(1)
    route = re.search(r"curl http://[^/\s]+(/\S+)", command).group(1)
    return route, json.loads(re.search(r"-d '(.*?)'", command, re.DOTALL).group(1))


@pytest.fixture(scope="module")
def smollm2_server():
    process = ServerProcess("--model", "smollm2")
    yield process.wait_ready()
    process.close()


def test_the_readme_example_gets_the_model_defaults_and_answers_paris(smollm2_server):
    route, body = readme_request()
    assert route == "/v1/chat/completions"
    assert not {"temperature", "top_p", "top_k", "min_p", "seed"} & set(body), "the example leaves sampling out"
    assert body["max_tokens"] <= 64  # a newcomer does not wait on a run to the context limit
    with openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0) as client:
        answer = client.chat.completions.create(**body)
    assert "Paris" in answer.choices[0].message.content, answer.choices[0].message.content
    assert answer.usage.completion_tokens <= body["max_tokens"]
    # The server announced the defaults it applied, at start.
    assert "temperature=0.2, top_p=0.9" in smollm2_server.logs()
    assert smollm2_server.client.get("/health").json() == {"status": "healthy"}
