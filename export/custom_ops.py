"""What Kiln's iree-turbine custom ops share: their library, MLIR text templates, and a
compatibility shim that lets iree-turbine 3.9 expand custom ops under iree-base-compiler 3.13.

A custom op is how the export emits an IREE op torch cannot reach (a whole-page gather, a
matmul whose inputs are narrower than its accumulator); eager torch runs its plain-torch twin.
"""

from __future__ import annotations

from iree.compiler import ir
from iree.turbine.runtime.op_reg import KernelBuilder, def_library, impl_helper

KILN_LIBRARY = def_library("kiln")

# iree-turbine 3.9 calls `SomeType.isinstance(x)`, which the MLIR Python bindings in
# iree-base-compiler 3.13 dropped; custom ops cannot expand without it. Python's own
# isinstance does the same job now that the bindings return the concrete class.
for _name in (
    "BlockArgument", "F16Type", "F32Type", "F64Type", "IndexType", "IntegerType",
    "MemRefType", "OpResult", "RankedTensorType", "ShapedType", "VectorType",
):
    _cls = getattr(ir, _name)
    if not hasattr(_cls, "isinstance"):
        setattr(_cls, "isinstance", staticmethod(lambda value, _cls=_cls: isinstance(value, _cls)))


class _TextTemplates(impl_helper.TemplateLoader):
    """Templates written in Python: the 'name' is the module's MLIR text."""

    def load_template(self, kb: KernelBuilder, name: str, **kwargs) -> ir.Operation:
        return self._parse_module_asm(kb, name)


_templates = _TextTemplates()


def static_dims(arg) -> list[int]:
    """The dims of a kernel-selection argument whose sizes are known at trace time."""
    return [i for i, size in enumerate(arg.t.shape) if isinstance(size, int)]


def type_ident(*types: ir.Type) -> str:
    """A symbol-safe spelling of tensor types, so each specialization gets a function of its own."""
    return "_".join(str(t).replace("tensor<", "").replace(">", "").replace("?", "D") for t in types)


def emit_function(kb: KernelBuilder, name: str, text: str) -> None:
    """Inline the MLIR module `text`, call its function `name` on the op's tensor arguments (an
    attribute argument, already spelled into the text, has no value) and yield its results."""
    function = _templates.inline_template_function(kb, text, name)
    kb.yield_results(*impl_helper.call_function(function, *(b for b in kb.arg_bindings if b is not None)))
