"""The flagship architectures end to end: openai client -> gateway -> attention -> two expert services.

Each must answer exactly what the single-process reference (`splitmoe generate --chat`) answers,
with its experts split across two services.
"""
from __future__ import annotations

import openai
import pytest

from tests.support.processes import run_splitmoe
from tests.support.stack import running_stack

MODELS = ["deepseek2/deepseek2-q8_0.gguf", "deepseek3/deepseek3-q4_k_m.gguf", "gptoss/gptoss-mxfp4_moe.gguf",
          "glm4moe/glm4moe-q8_0.gguf", "llama4/llama4-q4_k_m.gguf"]
PROMPT = "def norm(v):"


@pytest.mark.parametrize("name", MODELS)
def test_streamed_chat_through_two_expert_services_equals_generate(fixtures_dir, tmp_path, name):
    model = fixtures_dir / name
    with running_stack(model, tmp_path) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=16, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    reference = run_splitmoe("generate", str(model), "--prompt", PROMPT, "--chat", "-n", "16")
    assert text and text == reference[:-1]
