"""What is checked: an implementation resolved from a SPEC, and how it is called.

``adapters`` (the Implementation and its three adapter kinds), ``torch_builtins``
and ``libraries`` (the built-ins), ``compiled`` (compiler settings), ``faults``
(the library of deliberately broken implementations), ``resolve`` (SPEC ->
Implementation; the table of built-ins).
"""
