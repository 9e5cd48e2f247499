"""The jaxprs inside a jaxpr's equations (scan and while bodies, pjit, custom_vjp, remat), for tests that count or
inspect the primitives a traced program runs."""

from __future__ import annotations


def sub_jaxprs(eqn):
    """The jaxprs among an equation's parameters (closed ones opened)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner
