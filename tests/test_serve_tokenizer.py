"""`tandem serve --chat-template`, `--tokenizer` and several `--served-model-name`s, on tiny
random models: what each changes (the chat prompt, the tokens, the names accepted), the YAML
keys that set them, and each refused in words where it cannot apply."""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest
from server_fixture import running_server

from tandem.cli import build_parser
from tandem.cluster.config import parse_cluster_config
from tandem.cluster.router.prefix import PromptTokenizer
from tandem.config import EngineConfig
from tandem.engine.tokenizer import get_tokenizer, read_chat_template
from tandem.server.api_server import ServerConfig
from tandem.server.launch import build_configs

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ASK = [{"role": "user", "content": "<1> <2> <3>"}]


def word_tokenizer(dst, size: int, chat_template: str | None = None) -> str:
    """A folder holding only a tokenizer of `size` tokens, each id decoding to its own word
    `<id>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = chat_template
    fast.save_pretrained(dst)
    return str(dst)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return word_tokenizer(
        tmp_path_factory.mktemp("tok"), 512
    )  # the tiny models' 512 embedding rows


def engine(model_dir: str, **kw) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=model_dir, dtype="float32", kv_cache_memory=1 << 22, num_threads=1, **kw
    )


def test_tokenizer_and_chat_template_are_served(tiny_model_dirs, tok_dir, tmp_path):
    """The tiny model ships no tokenizer: --tokenizer gives it one (text prompts work), and
    --chat-template (a file) the chat prompt; /tokenize shows what a chat request sends."""
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    cfg = engine(
        tiny_model_dirs["llama"], tokenizer=tok_dir, chat_template=str(tmp_path / "t.jinja")
    )
    with running_server(cfg, ServerConfig(model_name="tiny")) as (url, _):
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "<5> <6>", "max_tokens": 2, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text
        ids = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": ASK}).json()[
            "tokens"
        ]
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "max_tokens": 2},
            timeout=30,
        )
    # "<user> <1> <2> <3>\n<assistant>": the unknown words are <0>, the rest their own ids
    assert ids == [0, 1, 2, 3, 0] and chat.json()["usage"]["prompt_tokens"] == 5
    inline = get_tokenizer(
        tiny_model_dirs["llama"], tok_dir, TEMPLATE
    )  # inline: the template itself
    assert inline.chat_template == TEMPLATE


def test_a_tokenizer_json_file_and_the_router_use_the_same_tokens(tiny_model_dirs, tok_dir):
    tok = get_tokenizer(tiny_model_dirs["llama"], tok_dir + "/tokenizer.json")
    assert tok.encode("<7> <8>") == [7, 8]
    router = PromptTokenizer(
        tiny_model_dirs["llama"], {"tokenizer": tok_dir, "chat_template": TEMPLATE}
    )
    assert router.token_ids("/v1/chat/completions", {"model": "tiny", "messages": ASK}) == [
        0,
        1,
        2,
        3,
        0,
    ]


@pytest.mark.parametrize(
    "kw,error,text",
    [
        (
            dict(chat_template="{% for m in messages %}{{ m }"),
            ValueError,
            "not a valid Jinja template (line 1)",
        ),
        (dict(chat_template="no/such/template.jinja"), FileNotFoundError, "no such file"),
        (
            dict(chat_template=TEMPLATE),
            ValueError,
            "ships no tokenizer to apply it with; give --tokenizer too",
        ),
        (dict(tokenizer="big"), ValueError, "600 tokens, but the model's embedding has 512 rows"),
        (
            dict(tokenizer="empty"),
            FileNotFoundError,
            "no tokenizer.json or tokenizer_config.json in it",
        ),
    ],
)
def test_refused_in_words(tiny_model_dirs, tmp_path, kw, error, text):
    if kw.get("tokenizer") == "big":
        kw["tokenizer"] = word_tokenizer(tmp_path / "big", 600)
    elif kw.get("tokenizer") == "empty":
        kw["tokenizer"] = str(tmp_path)
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        get_tokenizer(tiny_model_dirs["llama"], **kw)


def test_several_served_model_names(tiny_model_dirs):
    server = ServerConfig(model_name="tiny", model_aliases=("chat", "assistant"))
    with running_server(engine(tiny_model_dirs["llama"]), server) as (url, _):
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [
            "tiny",
            "chat",
            "assistant",
        ]
        for name in ("tiny", "chat", "assistant"):
            r = httpx.post(
                url + "/v1/completions",
                json={"model": name, "prompt": [1, 2], "max_tokens": 1},
                timeout=30,
            )
            assert r.status_code == 200 and r.json()["model"] == "tiny", (
                r.text
            )  # the first name is reported
        r = httpx.post(
            url + "/v1/completions", json={"model": "other", "prompt": [1, 2], "max_tokens": 1}
        )
    assert r.status_code == 404
    assert (
        r.json()["error"]["message"]
        == "The model `other` does not exist; this server serves `tiny`, `chat`, `assistant`."
    )


def test_flags_and_yaml(tmp_path):
    parse = build_parser().parse_args
    eng, srv = build_configs(
        parse(
            [
                "serve",
                "--served-model-name",
                "a",
                "b",
                "--tokenizer",
                "T",
                "--chat-template",
                "C.jinja",
            ]
        )
    )
    model = eng.model_config
    got = (srv.model_name, srv.model_aliases, model.tokenizer, model.chat_template)
    assert got == ("a", ("b",), "T", "C.jinja")
    (tmp_path / "s.yaml").write_text(
        "serving:\n  engine: {tokenizer: T, chat_template: C.jinja}\n"
        "  server: {served_model_name: [x, y, z]}\n"
    )
    eng, srv = build_configs(parse(["serve", "--config", str(tmp_path / "s.yaml")]))
    model = eng.model_config
    got = (srv.served_model_names, model.tokenizer, model.chat_template)
    assert got == (("x", "y", "z"), "T", "C.jinja")
    eng, srv = build_configs(
        parse(["serve", "--config", str(tmp_path / "s.yaml"), "--served-model-name", "q"])
    )
    assert srv.served_model_names == ("q",)  # the flag wins
    _, srv = build_configs(parse(["serve", "--model", "m"]))
    assert srv.served_model_names == ("m",)
    with pytest.raises(ValueError, match="served model names must be distinct"):
        build_configs(parse(["serve", "--served-model-name", "a", "a"]))
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--chat-template", "--tokenizer", "--served-model-name"):
        assert flag in help_text
    assert "(default: the model's own)" in help_text
    assert "(default: the tokenizer's own)" in " ".join(help_text.split())


def test_cluster_config_refuses_what_cannot_apply():
    emb = {
        "name": "e",
        "model": "all-minilm-l6-v2",
        "kind": "embedding",
        "engine": {"chat_template": TEMPLATE},
    }
    with pytest.raises(
        ValueError, match=r"models\[0\].engine: chat_template cannot apply to an embedding model"
    ):
        parse_cluster_config({"models": [emb]})
    bad = {"name": "c", "model": "smollm2-135m", "engine": {"chat_template": "{% if %}"}}
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        parse_cluster_config({"models": [bad]})
    assert read_chat_template(TEMPLATE) == TEMPLATE


def test_one_tokenizer_per_process_for_a_source_until_its_files_change(tiny_model_dirs, tmp_path):
    """Callers in one process (engine core, front end, router, several LLMs) share the tokenizer
    loaded once while one of them holds it, and it is freed once none does; a --chat-template goes
    on a copy, never on the shared one; a tokenizer file written again is loaded again."""
    src = word_tokenizer(tmp_path / "tok", 64, chat_template="{{ 'own' }}")
    model = tiny_model_dirs["llama"]
    first = get_tokenizer(model, src)
    assert get_tokenizer(model, src) is first
    templated = get_tokenizer(model, src, TEMPLATE)
    assert templated is not first and templated.chat_template == TEMPLATE
    assert (
        first.chat_template == "{{ 'own' }}"
        and get_tokenizer(model, src).chat_template == "{{ 'own' }}"
    )
    word_tokenizer(tmp_path / "tok", 32)  # the same folder, rewritten
    again = get_tokenizer(model, src)
    assert again is not first and len(again) == 32
    gone = weakref.ref(again)
    del again
    gc.collect()
    assert gone() is None  # the cache alone does not keep a tokenizer alive
