import pytest

from jaxllm.loading import load_tokenizer
from jaxllm.tokenizer.chat_template import ChatTemplate, ChatTemplateError

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Tell me a joke about \"quotes\" & ünïcode"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:2]])
def test_smollm2_template_matches_transformers(smollm2_path, messages, add_generation_prompt):
    import transformers

    tok = load_tokenizer(smollm2_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    hf.chat_template = tok.chat_template.source
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    if add_generation_prompt:
        assert expected.endswith("<|im_start|>assistant\n")


def test_template_cannot_reach_python_internals():
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])
    mutating = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        mutating.render([{"role": "user", "content": "x"}])


def test_raise_exception_and_tojson():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                     "{{ messages | tojson }}")
    assert t.render([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'
    with pytest.raises(ChatTemplateError, match="user first"):
        t.render([{"role": "system", "content": "x"}])
