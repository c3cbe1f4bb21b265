"""An adapter's own chat template: read from a PEFT directory, kept by the converter in the GGUF
adapter (`adapter.chat_template`), part of its fingerprint, shown by `loraplex inspect`."""

from __future__ import annotations

import json

import pytest
from gguf import GGUFValueType

from gateway.cli import main as cli_main
from tests.gateway.gateway_setup import ATTN
from tests.tinymodels import random_lora, write_adapter
from tests.worker.formats.test_peft_convert import make_peft
from worker.formats.adapter import AdapterError, load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.formats.peft_convert import ConversionError, ConvertOptions, convert_peft_to_gguf
from worker.formats.peft_template import TemplateFileError, peft_chat_template

TEMPLATE = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"


def test_the_directory_s_template_file_wins_over_tokenizer_config(tmp_path) -> None:
    assert peft_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))
    assert peft_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert peft_chat_template(tmp_path) == TEMPLATE
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "named"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert peft_chat_template(tmp_path) == "named"
    (tmp_path / "chat_template.jinja").write_text("from the file")
    assert peft_chat_template(tmp_path) == "from the file"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(TemplateFileError, match="must be a string"):
        peft_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TemplateFileError, match="cannot be read"):
        peft_chat_template(tmp_path)


def test_a_converted_peft_adapter_keeps_its_template(tiny_llama, tmp_path, capsys) -> None:
    peft = tmp_path / "peft"
    make_peft(tiny_llama, peft, seed=4, target_modules=["q_proj", "v_proj"])
    base = GGUFFile(tiny_llama.path)
    convert_peft_to_gguf(peft, tiny_llama.path, tmp_path / "plain.gguf", ConvertOptions())
    plain = load_adapter(tmp_path / "plain.gguf", base)
    (peft / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    convert_peft_to_gguf(peft, tiny_llama.path, tmp_path / "own.gguf", ConvertOptions())
    own = load_adapter(tmp_path / "own.gguf", base)
    assert plain.chat_template is None and own.chat_template == TEMPLATE
    assert GGUFFile(tmp_path / "own.gguf").get("adapter.chat_template") == TEMPLATE
    # the same weights with a template are another file: another fingerprint (a template-less one keeps its digest)
    assert own.fingerprint != plain.fingerprint and own.pairs.keys() == plain.pairs.keys()
    code = cli_main(["convert-lora", str(peft), "--base", str(tiny_llama.path), "-o", str(tmp_path / "cli.gguf")])
    assert code == 0 and "chat template: " in capsys.readouterr().out
    assert load_adapter(tmp_path / "cli.gguf").fingerprint == own.fingerprint
    (tmp_path / "other.jinja").write_text("{{ messages[0].content }}")
    code = cli_main(["convert-lora", str(peft), "--base", str(tiny_llama.path), "-o", str(tmp_path / "cli2.gguf"),
                     "--chat-template", str(tmp_path / "other.jinja")])
    assert code == 0 and load_adapter(tmp_path / "cli2.gguf").chat_template == "{{ messages[0].content }}"
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "own.gguf"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["adapter"]["chat_template"] == TEMPLATE
    assert cli_main(["inspect", str(tmp_path / "own.gguf")]) == 0
    assert f"{len(TEMPLATE)} characters" in capsys.readouterr().out
    (peft / "tokenizer_config.json").write_text(json.dumps({"chat_template": ["no", "names"]}))
    with pytest.raises(ConversionError, match="named templates"):
        convert_peft_to_gguf(peft, tiny_llama.path, tmp_path / "bad.gguf", ConvertOptions())


def test_an_adapter_template_of_the_wrong_type_is_refused(tiny_llama, tmp_path) -> None:
    pairs = random_lora(tiny_llama, ATTN, 4, seed=1)
    path = write_adapter(tmp_path / "bad.gguf", pairs, metadata={"adapter.chat_template": (GGUFValueType.UINT32, 7, None)})
    with pytest.raises(AdapterError, match="invalid gguf type for adapter.chat_template"):
        load_adapter(path)
