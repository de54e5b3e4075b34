"""LLM.chat renders conversations with a chat template and generates like LLM.generate on the
rendered prompt; stories260K's tokenizer has no template, which is a clear error."""
import os

import pytest

from conftest import ROOT
from pagedgen import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
CONV = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time"}]



def test_chat_equals_generate_on_the_rendered_prompt(llm):
    out = llm.chat(CONV[:1], GREEDY, chat_template=TEMPLATE, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == "<s>user: Tell me a story.\nassistant:"
    ids = llm.tokenizer(out[0].prompt, add_special_tokens=False).input_ids
    assert out[0].prompt_token_ids == ids and ids[0] == llm.tokenizer.bos_token_id and ids.count(ids[0]) == 1
    ref = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert out[0].outputs[0].token_ids == ref.outputs[0].token_ids and out[0].outputs[0].text == ref.outputs[0].text


def test_chat_with_the_tokenizers_own_template_and_many_conversations(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", TEMPLATE, raising=False)
    outs = llm.chat([CONV[:1], CONV], [GREEDY, GREEDY.clone(max_tokens=4)], use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1"]
    assert outs[1].prompt.endswith("assistant: Once upon a time\nassistant:")
    assert len(outs[1].outputs[0].token_ids) == 4


def test_continue_final_message(llm):
    out = llm.chat(CONV, GREEDY, chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt.endswith("assistant: Once upon a time")  # no end of turn: the reply continues it


def test_no_template_is_a_clear_error(llm):
    assert not getattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="the tokenizer has no chat template: pass chat_template="):
        llm.chat(CONV[:1], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "messages, kwargs, error, match",
    [
        ([{"role": "user"}], {}, ValueError, r"conversation 0, message 0 must be a dict with str 'role' and 'content'"),
        ([[{"role": "user", "content": "a"}], [{"content": "b"}]], {}, ValueError, r"conversation 1, message 0"),
        ("hello", {}, TypeError, r"messages must be a conversation"),
        (CONV, dict(continue_final_message=True), ValueError, r"add_generation_prompt and continue_final_message"),
        ([[]], {}, ValueError, r"conversation 0 is empty"),
    ],
)
def test_bad_chat_input(llm, messages, kwargs, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages, GREEDY, chat_template=TEMPLATE, use_tqdm=False, **kwargs)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "template, match",
    [("{% for %}", r"the chat template failed on conversation 0"), ("", "chat_template must be a non-empty Jinja"), (123, "chat_template must be")],
)
def test_bad_chat_template(llm, template, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(CONV, GREEDY, chat_template=template, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_example_chat_template_file_renders_like_the_template_above(stories_path):
    """docs/cli.md's chat examples use examples/chat_template.jinja: it renders as TEMPLATE does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    with open(os.path.join(ROOT, "examples", "chat_template.jinja"), encoding="utf-8") as f:
        from_file = f.read()
    for gen in (True, False):
        want = tok.apply_chat_template(CONV, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(CONV, chat_template=from_file, tokenize=False, add_generation_prompt=gen) == want
