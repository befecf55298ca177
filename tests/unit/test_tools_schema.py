"""rlcu.tools.schema against transformers' get_json_schema (the oracle): equal schemas for functions
of every supported hint and docstring shape, errors naming the function and parameter, and chat
templates rendered with Python functions in tools= equal to apply_chat_template's (Qwen2.5, Llama 3.1)."""

import enum
from typing import Literal, Optional, Union

import pytest
from support import chat_families as cf

from rlcu.data.chat_template import render_chat
from rlcu.data.tokenizer import Tokenizer
from rlcu.tools.schema import ToolSchemaError, json_schema


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. "Paris".
        unit: The temperature unit.

    Returns:
        The weather as a sentence.
    """


def add(a: int, b: float, c: bool = False):
    """Add two numbers & return <their> sum.

    Args:
        a (int): The first number.
        b (float): The second number,
            which may have a fraction.
        c: Round the result.
    """


def search(query: str, tags: list[str], limits: dict[str, int], n: Optional[int] = None,  # noqa: UP045 (typing's form)
           key: int | str = 0, either: Union[list[int], str, None] = None,  # noqa: UP007 (typing's form)
           anything: list = ()) -> dict[str, list[int]]:
    """Search the index.

    The second paragraph of the description
    spans two lines.

    Args:
        query: The query.
        tags: Tags to filter by.
        limits: A limit per field.
        n: How many results (None: all).
        key: A key.
        either: A list of ids or a name.
        anything: Anything at all.

    Returns:
        Hits per field,
        as lists of ids.

    Raises:
        ValueError: never.
    """


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def paint(color: Color, drink: str, pair: tuple[int, str], level: Literal[1, 2, "max"] = 1) -> object:
    """Paint something.

    Args:
        color: The colour.
        drink: What to drink while painting (choices: ["tea", "coffee"])
        pair: A number and a name.
        level: How much.
    """


class Shop:
    def buy(self, item: str) -> bool:
        """Buy an item.

        Args:
            item: What to buy.
        Returns:
            Whether it was bought.
        """


@pytest.mark.parametrize("fn", [get_weather, add, search, paint, Shop().buy], ids=lambda f: f.__name__)
def test_schema_equals_transformers(fn):
    from transformers.utils import get_json_schema
    assert json_schema(fn) == get_json_schema(fn)


def no_hint(a: int, b):
    """Nothing.

    Args:
        a: A.
        b: B.
    """


def no_entry(a: int, b: str):
    """Nothing.

    Args:
        a: A.
    """


def no_doc(a: int):
    pass


class Custom:
    pass


def custom_hint(a: Custom):
    """Nothing.

    Args:
        a: A.
    """


@pytest.mark.parametrize("fn, words", [(no_hint, ["no_hint", "'b'", "type hint"]),
                                       (no_entry, ["no_entry", "'b'", "Args:"]),
                                       (no_doc, ["no_doc", "docstring"]),
                                       (custom_hint, ["custom_hint", "'a'", "Custom"])])
def test_errors_name_function_and_parameter(fn, words):
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException
    with pytest.raises((DocstringParsingException, TypeHintParsingException)):  # transformers refuses them too
        get_json_schema(fn)
    with pytest.raises(ToolSchemaError) as e:
        json_schema(fn)
    assert all(w in str(e.value) for w in words), str(e.value)


CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("kind", ["qwen25", "llama31"])
def test_render_with_functions_equals_transformers(kind, tmp_path):
    from transformers import AutoTokenizer
    folder = {"qwen25": cf.qwen25_folder, "llama31": cf.llama3_folder}[kind](tmp_path)
    ours, hf = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder))
    tools = [get_weather, add, search]
    text = ours.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True)
    assert text == hf.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "Get the current weather in a city." in text
    # a function and its schema dict render the same
    assert text == ours.apply_chat_template(CHAT, tools=[json_schema(f) for f in tools], add_generation_prompt=True)


def test_render_refuses_what_is_no_tool():
    with pytest.raises(ToolSchemaError, match="functions, got int"):
        render_chat("{{ tools }}", CHAT, tools=[3])
