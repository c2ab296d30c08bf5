"""Structured output with xgrammar on the real default model: JSON schema, regex, choice, EBNF, batch isolation,
finish reasons and compiler errors; offline through `LLM` and over HTTP. Slow: constrained generations of the real
model (one test alone runs ~45 s on 2 cores), and a real server."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from helpers import MODEL
from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.sampling_params import ParamError

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "artist", "teacher"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9] | [1-9] [0-9]
"""


def chat_prompt(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def valid_person(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_json_schema_always_validates_and_free_text_does_not(llm):
    """40 sampled generations under the schema all validate; 20 without it, from the same prompt and seeds,
    fail measurably (fewer than 90% valid)."""
    prompt = chat_prompt(llm, "Give a person as JSON with name, age, role, address (city, zip) and skills.")
    constrained = [SamplingParams(temperature=0.8, max_tokens=160, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=PERSON)) for i in range(40)]
    free = [SamplingParams(temperature=0.8, max_tokens=160, seed=i) for i in range(20)]
    outs = llm.generate([prompt] * 60, constrained + free, use_tqdm=False)
    good_constrained = sum(valid_person(o.outputs[0].text) for o in outs[:40])
    good_free = sum(valid_person(o.outputs[0].text) for o in outs[40:])
    print(f"\nnested JSON schema at T=0.8: constrained {good_constrained}/40 valid, "
          f"unconstrained {good_free}/20 valid")
    assert good_constrained == 40, [o.outputs[0].text for o in outs[:40] if not valid_person(o.outputs[0].text)][:3]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:40])
    assert good_free < 18  # the same prompts fail measurably without the constraint


def test_regex_choice_and_ebnf_always_match(llm):
    regex = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}"
    choices = ["positive", "negative", "neutral"]
    reqs = ([(chat_prompt(llm, "A name and phone number:"), StructuredOutputsParams(regex=regex))] * 12
            + [(chat_prompt(llm, "Sentiment of 'I love it'?"), StructuredOutputsParams(choice=choices))] * 12
            + [(chat_prompt(llm, "Write an arithmetic expression."), StructuredOutputsParams(grammar=ARITHMETIC))] * 12)
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i, structured_outputs=spec)
              for i, (_, spec) in enumerate(reqs)]
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(regex, t) for t in texts[:12]), texts[:12]
    assert all(t in choices for t in texts[12:24]), texts[12:24]
    expression = re.compile(r"[0-9()+\-*/]+")
    for t in texts[24:]:
        assert expression.fullmatch(t), t
        if outs[texts.index(t)].outputs[0].finish_reason == "stop":
            eval(compile(t, "<expr>", "eval"), {})  # a complete expression parses; ZeroDivisionError is fine
    # The choice constraint admits every choice and leaves the pick to the model: sampled at temperature 1, twelve
    # seeds give more than one answer (measured: 4 positive, 8 negative), and each answer is complete.
    assert len(set(texts[12:24])) >= 2, texts[12:24]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[12:24])


def test_free_requests_are_untouched_by_constrained_neighbours(llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    constrained = SamplingParams(temperature=0.9, max_tokens=40, seed=3,
                                 structured_outputs=StructuredOutputsParams(json=PERSON))
    mixed = llm.generate([prompts[0], "JSON please:", prompts[1], "More JSON:", prompts[2]],
                         [greedy, constrained, greedy, constrained, greedy], use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone


def test_length_cut_and_compiler_errors(llm):
    out = llm.generate([chat_prompt(llm, "A person:")], SamplingParams(
        temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(json=PERSON)), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"  # max_tokens came before the grammar's end
    with pytest.raises(ParamError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a[")), use_tqdm=False)
    with pytest.raises(ParamError, match="json"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "objectx"})), use_tqdm=False)
    with pytest.raises(ParamError):
        StructuredOutputsParams(regex="a", choice=["b"])


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
ANSWER_TAG = {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": CITY},
              "end": "</answer>"}
LEGACY_TAG = {"structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}],
              "triggers": ["<function="]}


def wrapped_city(text: str) -> bool:
    match = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)
    try:
        jsonschema.validate(json.loads(match.group(1)), CITY)
        return True
    except (AttributeError, ValueError, jsonschema.ValidationError):
        return False


def test_structural_tags_always_match(llm):
    """xgrammar's structural tag (vLLM's structural_tag): a tag around a JSON schema, sampled with several seeds."""
    spec = StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": ANSWER_TAG}))
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i, structured_outputs=spec) for i in range(4)]
    outs = llm.generate([chat_prompt(llm, "Which city is the capital of France?")] * 4, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(wrapped_city(t) for t in texts), texts


def test_legacy_structural_tag_opens_on_its_trigger(llm):
    """vLLM's legacy form: free text until a trigger, then the structure's begin, JSON of its schema, and end.
    Checked with the compiled grammar's own matcher on texts the model need not write."""
    from tokenmill.engine.structured_output import GrammarCompiler
    compiler = GrammarCompiler(llm.tokenizer, len(llm.tokenizer))
    compiled = compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(LEGACY_TAG)))

    def accepts(text: str) -> bool:
        return compiler.xgr.GrammarMatcher(compiled).accept_string(text)
    assert accepts('Let me check. <function=get_weather>{"city": "Paris"}</function> Done.')
    assert accepts("No call at all.")
    assert not accepts('<function=get_weather>{"town": "Paris"}')  # the schema holds inside the structure
    assert not accepts("<function=get_time>")  # a trigger opens one of the structures only
    with pytest.raises(ParamError, match="begin, schema and end"):
        compiler.compile(StructuredOutputsParams(structural_tag=json.dumps({"structures": [{"begin": "a"}],
                                                                               "triggers": ["a"]})))


# ---- over HTTP ----

def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url_for(path), headers=server.headers(), json={"model": MODEL, **body}, timeout=120)


def test_openai_response_format_and_vllm_fields(server):
    import openai
    client = server.openai()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=160, temperature=0.7,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert valid_person(r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
        max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)

    choice = post(server, "/v1/completions", {"prompt": "Yes or no?", "max_tokens": 5, "temperature": 1.0,
                                              "guided_choice": ["yes", "no"]}).json()
    assert choice["choices"][0]["text"] in ("yes", "no")
    regex = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "A code"}],
                                                  "max_tokens": 12, "structured_outputs": {"regex": "[A-F]{4}"}})
    assert re.fullmatch("[A-F]{4}", regex.json()["choices"][0]["message"]["content"])
    # streaming: the deltas join into valid output
    with client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person"}],
                                        max_tokens=160, temperature=0.5, stream=True,
                                        extra_body={"guided_json": PERSON}) as stream:
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert valid_person(text)

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"guided_regex": "a("})
    assert "regex" in err.value.body["message"].lower() or "regex" in str(err.value).lower()
    bad = post(server, "/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}})
    assert bad.status_code == 400 and "objectx" in bad.json()["error"]["message"]
    both = post(server, "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})
    assert both.status_code == 400


def test_structural_tag_over_http(server):
    """vLLM's response_format structural_tag, in both forms, and structured_outputs.structural_tag; malformed ones
    are 400s naming response_format."""
    chat = {"messages": [{"role": "user", "content": "Which city is the capital of Italy?"}], "max_tokens": 40,
            "temperature": 0.8}
    tagged = post(server, "/v1/chat/completions", {**chat, "response_format": {"type": "structural_tag",
                                                                                "format": ANSWER_TAG}})
    assert tagged.status_code == 200 and wrapped_city(tagged.json()["choices"][0]["message"]["content"]), tagged.text
    as_text = post(server, "/v1/completions", {"prompt": "The capital of Spain:", "max_tokens": 40,
                                               "structured_outputs": {"structural_tag": json.dumps(
                                                   {"type": "structural_tag", "format": ANSWER_TAG})}})
    assert wrapped_city(as_text.json()["choices"][0]["text"]), as_text.text
    legacy = post(server, "/v1/chat/completions", {**chat, "max_tokens": 8,
                                                   "response_format": {"type": "structural_tag", **LEGACY_TAG}})
    assert legacy.status_code == 200, legacy.text
    for bad in ({"type": "structural_tag"}, {"type": "structural_tag", "format": ANSWER_TAG, **LEGACY_TAG},
                {"type": "structural_tag", "structures": LEGACY_TAG["structures"], "triggers": []},
                {"type": "structural_tag", "format": {"type": "no-such-format"}},
                {"type": "json_object", "format": ANSWER_TAG}):
        r = post(server, "/v1/chat/completions", {**chat, "response_format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", (bad, r.text)
