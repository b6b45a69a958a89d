"""The YAML loader of configs: yaml.SafeLoader (no python tags: a config never executes code) that also refuses
a mapping with the same key twice, where PyYAML keeps the last one silently.

    yaml.load("train: {steps: 5}", Loader=UniqueKeyLoader)            # {'train': {'steps': 5}}
    yaml.load("steps: 5\nsteps: 50", Loader=UniqueKeyLoader)          # DuplicateKey: 'steps', line 2, first 1

load_yaml turns DuplicateKey into a ConfigError naming the file, the key and the lines.
"""
from __future__ import annotations

import yaml

from moelab.config.rules import ConfigError


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping that gives `key` twice: on line `line`, first on line `first` (1-based).

        try: yaml.load("a: 1\na: 2", Loader=UniqueKeyLoader)
        except DuplicateKey as e: e.key, e.line, e.first     # ('a', 2, 1)
    """

    def __init__(self, key, line: int, first: int):
        super().__init__(None, None, f"key {key!r} given twice (lines {first} and {line})")
        self.key, self.line, self.first = key, line, first


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that raises DuplicateKey for a key given twice in one mapping (a merge, `<<: *base`,
    followed by an overriding key stays allowed).

        yaml.load("base: &b {x: 1}\nrun: {<<: *b, x: 2}", Loader=UniqueKeyLoader)   # {'base': {'x': 1}, 'run': {'x': 2}}
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in first:
                        raise DuplicateKey(key, line, first[key])
                    first[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
        return super().construct_mapping(node, deep)


def load_yaml(text: str, where: str, file: bool = True):
    """YAML text -> Python, refusing duplicated keys with a ConfigError naming the key (and its lines in a
    `file`)."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKey as e:
        lines = f"{where}:{e.line}: key {e.key!r} is given twice (first on line {e.first})" if file else \
            f"{where}: key {e.key!r} is given twice"
        raise ConfigError(f"{lines}; keep one of them (YAML would silently use the last)") from None
