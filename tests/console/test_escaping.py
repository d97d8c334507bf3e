"""Every string the console shows is escaped: a property of the templates and of the console's code, not a list
of fields (issue 30, section 6).

Autoescaping is on for every template; no template turns it off for a value (``|safe``, ``map('safe')``,
``{% filter safe %}``, ``{% autoescape false %}``, a ``Markup`` global); the console's own filters return
plain text (escaped on output like any value); and the only markup made in Python is the allow-list below,
each entry with why it holds no unescaped text. A new field, template or filter is covered without being
named here. The pages rendered with hostile strings in every free-form field are in test_console_http.py
and test_console_browser.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from jinja2 import nodes
from jinja2.filters import FILTERS as JINJA_FILTERS

from cgstore.console import router
from cgstore.console.router import TEMPLATES

CONSOLE = Path(router.__file__).parent
TEMPLATE_FILES = sorted(path.name for path in (CONSOLE / "templates").glob("*.html"))
#: Filters that hand their input to the page unescaped.
UNESCAPING = {"safe"}
#: Filters that apply another filter named by a string argument (``map('safe')``).
APPLYING = {"map", "select", "reject"}
#: (module, function) that may build ``Markup``, and why what they build holds no unescaped text.
MARKUP_ALLOWED = {
    ("charts.py", "fit_chart"): "an SVG of numbers; every lane name passes markupsafe.escape (test_console_http)",
    ("charts.py", "growth_chart"): "an SVG of numbers; every day label passes markupsafe.escape",
}
#: One hostile input per filter the console adds (a new filter must be added here, and so looked at).
HOSTILE_INPUT = {
    "pretty": {"<script>k</script>": ["<img src=x onerror=alert(1)>"]},
    "plain": {"<script>k</script>": ["<img src=x onerror=alert(1)>"]},
    "bytes": 5 << 20,
}


def test_every_template_file_is_one_the_environment_loads_and_autoescapes():
    assert TEMPLATE_FILES and TEMPLATES.list_templates() == TEMPLATE_FILES
    for name in TEMPLATE_FILES:
        autoescape = TEMPLATES.autoescape(name) if callable(TEMPLATES.autoescape) else TEMPLATES.autoescape
        assert autoescape is True, name


def _unescaped(name: str) -> list[str]:
    """Where ``name`` lets a value out unescaped: ``template:line what``."""
    tree = TEMPLATES.parse(TEMPLATES.loader.get_source(TEMPLATES, name)[0], name=name)
    found = []
    for node in tree.find_all(
        (nodes.Filter, nodes.EvalContextModifier, nodes.MarkSafe, nodes.MarkSafeIfAutoescape, nodes.Name)
    ):
        if isinstance(node, nodes.Filter) and node.name in UNESCAPING:
            found.append(f"|{node.name}")
        elif (
            isinstance(node, nodes.Filter)
            and node.name in APPLYING
            and any(isinstance(arg, nodes.Const) and arg.value in UNESCAPING for arg in node.args)
        ):
            found.append(f"|{node.name}({node.args[0].value!r})")
        elif isinstance(node, nodes.EvalContextModifier):  # {% autoescape ... %}, scoped or not
            found.append("autoescape block")
        elif isinstance(node, nodes.MarkSafe | nodes.MarkSafeIfAutoescape):
            found.append("marked safe")
        elif isinstance(node, nodes.Name) and node.name.lower() == "markup":
            found.append("Markup")
        else:
            continue
        found[-1] = f"{name}:{node.lineno} {found[-1]}"
    return found


@pytest.mark.parametrize("name", TEMPLATE_FILES)
def test_no_template_lets_a_value_out_unescaped(name):
    assert _unescaped(name) == []


def test_the_check_finds_each_way_of_unescaping(monkeypatch):
    """The property is only as good as its parser: each spelling of "unescaped" is found."""
    sources = {
        "a.html": "{{ m.evidence.mint_phases | pretty | safe }}",
        "b.html": "{% for r in view %}<h2>Published by {{ r.publisher.principal|safe }}</h2>{% endfor %}",
        "c.html": "{{ names | map('safe') | join(', ') }}",
        "d.html": "{% filter safe %}{{ x }}{% endfilter %}",
        "e.html": "{% autoescape false %}{{ x }}{% endautoescape %}",
        "f.html": "{{ Markup(x) }}",
    }
    from jinja2 import DictLoader

    monkeypatch.setattr(TEMPLATES, "loader", DictLoader(sources))
    assert {name: len(_unescaped(name)) for name in sources} == dict.fromkeys(sources, 1)


@pytest.mark.parametrize("name", sorted(set(TEMPLATES.filters) - set(JINJA_FILTERS)))
def test_the_consoles_filters_return_plain_text(name):
    assert name in HOSTILE_INPUT, f"a new filter {name!r}: add a hostile input for it here"
    shown = TEMPLATES.filters[name](HOSTILE_INPUT[name])
    assert type(shown) is str and not hasattr(shown, "__html__")  # escaped on output like any value
    assert TEMPLATES.from_string(f"{{{{ x | {name} }}}}").render(x=HOSTILE_INPUT[name]).count("<") == 0


class _MarkupMakers(ast.NodeVisitor):
    """(module, innermost function) of every ``Markup(...)`` call and ``__html__`` method in a module."""

    def __init__(self, module: str) -> None:
        self.module, self.where, self.found = module, ["<module>"], set()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:  # noqa: N802 (ast's name)
        if node.name == "__html__":
            self.found.add((self.module, node.name))
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        if (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == "Markup":
            self.found.add((self.module, self.where[-1]))
        self.generic_visit(node)


def test_markup_is_made_only_where_the_allow_list_says_why():
    makers = set()
    for path in sorted(CONSOLE.glob("*.py")):
        visitor = _MarkupMakers(path.name)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        makers |= visitor.found
    assert makers == set(MARKUP_ALLOWED)
