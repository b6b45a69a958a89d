"""The YAML loader of configs: yaml.SafeLoader (no python tags: a config never executes code) that also refuses
a mapping with the same key twice, where PyYAML keeps the last one silently.

    yaml.load("train: {steps: 5}", Loader=UniqueKeyLoader)            # {'train': {'steps': 5}}
    yaml.load("steps: 5\nsteps: 50", Loader=UniqueKeyLoader)          # DuplicateKey: 'steps', line 2, first 1

load_yaml turns DuplicateKey into a ConfigError naming the file, the key and the lines. It also refuses a
document whose aliases expand to more than MAX_NODES nodes (an alias bomb, `a: &a [x, x]`, `b: &b [*a, *a]`, ...,
would take the later steps forever) or that refers to itself, and read_text refuses any file that is not a
regular file of at most MAX_BYTES (`base: /dev/zero` would read without end).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from moelab.config.rules import ConfigError, shown

MAX_BYTES = 1 << 20   # a config file (the largest preset is a few KB)
MAX_NODES = 100_000   # YAML nodes once aliases are expanded (a full config has a few hundred)


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
        """SafeLoader's mapping, after checking its keys are unique (DuplicateKey names the key and both lines; a
        key after a merge may override the merged one)."""
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
    loader = UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and expanded_size(node) > MAX_NODES:
            raise ConfigError(f"{where}: its aliases (*name) expand to more than {MAX_NODES} values; a config "
                              f"needs a few hundred: write the values out")
        return loader.construct_document(node) if node is not None else None
    except DuplicateKey as e:
        lines = f"{where}:{e.line}: key {e.key!r} is given twice (first on line {e.first})" if file else \
            f"{where}: key {e.key!r} is given twice"
        raise ConfigError(f"{lines}; keep one of them (YAML would silently use the last)") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read; a config is a few levels deep") from None
    finally:
        loader.dispose()


def expanded_size(node, limit: int = MAX_NODES) -> int:
    """How many nodes the YAML graph under `node` has with every alias written out (each shared node counted
    once per reference), stopping past `limit`; ConfigError for a node that contains itself."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(n) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in open_ids:
            raise ConfigError(f"a YAML alias refers to a value that contains it (at line {n.start_mark.line + 1});"
                              f" a config is a tree")
        open_ids.add(id(n))
        children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
            n.value if isinstance(n, yaml.SequenceNode) else []
        total = 1
        for c in children:
            total += size(c)
            if total > limit:
                break
        open_ids.discard(id(n))
        sizes[id(n)] = total
        return total

    return size(node)


def read_text(path: "str | Path", what: str = "config file",
              fix: str = "give a YAML file or a preset name") -> str:
    """A config file's (or another small text file's, `what`) text: a regular file of at most MAX_BYTES, else a
    ConfigError naming it and `fix`."""
    path = Path(path)
    try:
        if not path.is_file():
            raise ConfigError(f"{what} {shown(str(path))} cannot be read (not a regular file); {fix}")
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what} {shown(str(path))} cannot be read ({e.strerror})") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{what} {shown(str(path))} is larger than {MAX_BYTES} bytes; a config is a few KB")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {shown(str(path))}: not valid YAML (not UTF-8 text: {e.reason} at byte "
                          f"{e.start})") from None
