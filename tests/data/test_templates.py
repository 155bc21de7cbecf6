"""Chat templates by name or file (data/templates.py), one mechanism for data.chat_template
and environment.chat_template; unset, the environment's is the data's."""

from __future__ import annotations

import pytest
from support.configs import minimal_run

from leangrpo.config import config_from_dict
from leangrpo.data.templates import BUNDLED_TEMPLATES, TemplateError, conversation_template


def env_config(data_template, env_template=None):
    return config_from_dict(
        minimal_run(
            data={"chat_template": data_template},
            environment={"tools": ["m.py:add"], "chat_template": env_template},
        )
    )


def test_the_environment_takes_the_data_template_unless_it_names_its_own(tmp_path):
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    hermes = BUNDLED_TEMPLATES["chatml-hermes"]
    assert conversation_template(env_config("chatml-hermes")) == hermes
    assert conversation_template(env_config(True)) is None  # the tokenizer's
    assert conversation_template(env_config(True, str(own))) == own.read_text()
    assert conversation_template(env_config(str(own), "chatml-hermes")) == hermes
    with pytest.raises(TemplateError, match="environment.chat_template = 'nope' is neither"):
        conversation_template(env_config(True, "nope"))


def test_an_empty_name_is_refused_by_the_config():
    with pytest.raises(Exception, match="data.chat_template"):
        config_from_dict(minimal_run(data={"chat_template": " "}))
