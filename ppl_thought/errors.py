"""Errors that name the problem (docs/architecture.md, "Rules that keep it right")."""

from __future__ import annotations


class PPLThoughtError(Exception):
    """Base class of every error raised on purpose by ppl_thought."""


class UnknownTokenError(PPLThoughtError, ValueError):
    """A token string or id that is not in the vocabulary."""


class NotInImageError(PPLThoughtError, ValueError):
    """An observation x outside the image of the projection (its lifting is empty)."""


class NotInDomainError(PPLThoughtError, ValueError):
    """A latent sequence z outside Dom(Proj^{<w}) (Def 2.6)."""


class TooLargeToEnumerateError(PPLThoughtError, ValueError):
    """An exact computation by enumeration would visit more sequences than allowed."""


class MalformedSequenceError(PPLThoughtError, ValueError):
    """A token array with the wrong shape, dtype, padding or length."""


class NotRegularError(PPLThoughtError, ValueError):
    """A language that no finite token automaton accepts (e.g. an unbounded thought schedule)."""


class NotDisentangledError(PPLThoughtError, ValueError):
    """A sampler that needs a disentangled projection (Def 3.5) was given one that is not."""


class ProgramError(PPLThoughtError, ValueError):
    """A ``pt.Program`` broke the step protocol (finished flags, state entries, steps past ``max_steps``)."""


class SiteMismatchError(PPLThoughtError, ValueError):
    """A guide does not sample exactly the model's latent sites (a name or a shape differs)."""


class ChunkMismatchError(SiteMismatchError):
    """SMC got a model and a guide whose steps end at different places: one encodes forced segments in chunks
    (``chunk > 0``, end of Section 5.6.2) and the other steps token by token."""


class ZeroWeightsError(PPLThoughtError, ValueError):
    """Every importance weight is zero (log weight -inf): the estimate of p(x) would be 0."""


class VocabularyError(PPLThoughtError, ValueError):
    """A vocabulary that cannot be built: an empty, duplicate or whitespace-containing token or special."""


class CheckpointError(PPLThoughtError, ValueError):
    """A checkpoint or saved result that cannot be loaded: bad or incomplete config, a tensors file that
    is missing, outside the folder, or does not match its SHA-256."""


class DiagnosticError(PPLThoughtError, ValueError):
    """A diagnostic asked of inputs it cannot measure (NaN log-probabilities, mismatched shapes)."""


class NumericalError(PPLThoughtError, ValueError):
    """A model produced NaN where a probability was due (NaN parameters or logits): never returned silently."""


class ConfigError(PPLThoughtError, ValueError):
    """An engine was configured with an invalid argument (e.g. ``SMC(..., groups=0)``)."""


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """No checkpoint (or saved result) at the given path."""


class SamplingBudgetError(PPLThoughtError, RuntimeError):
    """A verifier-assisted sampler used up its budget (rounds or proposals) before it had every sample."""


class UnsatisfiableConstraintError(PPLThoughtError, ValueError):
    """The process verifier rejects the empty prefix: no string of the constraint set exists (FAIL, Def 3.1.2)."""


class PatternError(PPLThoughtError, ValueError):
    """A regular expression that cannot be compiled to a character automaton: malformed (unbalanced
    parenthesis, nothing to repeat, bad escape, bad character range) or outside the regular subset
    supported (anchors, backreferences, lookarounds, possessive quantifiers); the message names the
    problem and its position."""

    def __init__(self, message: str, pattern: str | None = None, pos: int | None = None):
        where = "" if pos is None else f" at position {pos}"
        shown = "" if pattern is None else f" in pattern {pattern!r}"
        super().__init__(f"{message}{where}{shown}")
        self.pattern, self.pos = pattern, pos


class DiscreteLatentError(PPLThoughtError, ValueError):
    """A model handed to a gradient-based sampler has latent sites with discrete support."""


class UnsupportedResultError(PPLThoughtError, TypeError):
    """An object handed to a converter or report that is not one of the library's results (or files)."""


class DependencyError(PPLThoughtError, ImportError):
    """An installed dependency whose version the library does not support (e.g. ArviZ 1.x)."""


class MissingDependencyError(DependencyError, ConfigError):
    """An optional dependency is not installed (e.g. ``transformers`` for ``pt.lm.HuggingFace``): the message
    names the extra to install."""


class DeviceMismatchError(PPLThoughtError, ValueError):
    """A model and its guide (or two LMs one engine runs together) live on different torch devices: the
    message names both devices (move one with ``.to(device)``) instead of a RuntimeError from inside torch."""


class TransformError(PPLThoughtError, ValueError):
    """A model transform (pt.transforms) cannot apply: no sequence site to act on, conflicting transforms
    (Persistent with Forgetful), a site without the vocabulary a transform needs."""


class ActiveLiftError(TransformError):
    """An active lifting model (Section 6) that cannot be built or used: a latent alphabet Omega with fewer
    than two tokens or with the format markers, a latent sequence outside Omega^T, LMs on other vocabularies."""


class ConcreteValueError(ProgramError):
    """A JAX program needed a concrete value (a numpy array, a Python int) where it got a traced one: an automaton
    built from an argument, ``int(t)``, a Python ``if`` on a sampled value. The message names the argument to pass
    with ``static=`` (a compile-time constant) or the ``jnp.where`` / mask to write instead."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of a public function or class whose type is not the one its signature declares (the type
    layer of :mod:`ppl_thought.validation`): the message names the callable, the argument, what it got and the
    declared type. A bad argument like any other (a :class:`ConfigError`) and a ``TypeError``."""


class ResultTypeError(PPLThoughtError, TypeError):
    """A public function returned a value outside its declared type: a defect of the library (please report it),
    raised by the type layer of :mod:`ppl_thought.validation` instead of handing the value on."""


class CheckpointWriteError(CheckpointError, OSError):
    """A file the library writes (checkpoint, result, JSON) could not be written (a full disk, no permission): the
    message names the file; the previous file, if any, is left as it was (the write is atomic). Also an
    ``OSError``, so code that catches the operating system's error keeps working."""


class SchemaError(CheckpointError):
    """A file whose content does not follow its format's schema (:mod:`ppl_thought.schemas`): another format
    version, a missing required key, a key the format does not have, a value of another type. The message names
    the file, the key and what was expected."""


class ResourceError(ConfigError, MemoryError):
    """A call whose arguments need more memory than the machine has (:mod:`ppl_thought.resources`), refused
    before anything is allocated (a :class:`ConfigError`: the arguments are what to change; a ``MemoryError``:
    what it prevents). The message names the argument, the estimate, the limit and the override (the
    ``PPL_THOUGHT_MAX_BYTES`` environment variable)."""


class TokenizerMismatchError(ConfigError):
    """A token automaton built from the token texts of another tokenizer than the LM's vocabulary (same size,
    other strings): it would admit tokens by their texts in the other tokenizer, and the LM would write strings
    outside the constraint. Rebuild it with ``token_automaton(dfa, token_texts(lm.vocab))``."""


# ---------------------------------------------------------------------------------------------- zero weights
def describe_proposal(guide: object) -> str:
    """What proposed the particles of a run, for a :class:`ZeroWeightsError` message: ``"the guide <name>"``, or
    the model's own prior when ``guide`` is ``None`` (bootstrap), never "the guide" when there is none."""
    if guide is None:
        return "the model's own prior (no guide: bootstrap)"
    if isinstance(guide, str):  # already described (e.g. "the LM proposal")
        return guide
    inner = getattr(getattr(guide, "make", None), "__self__", None)  # SMC's SequenceGuide(sampler.dist): the sampler
    guide = guide if inner is None else inner
    name = guide.__name__ if isinstance(guide, type) or callable(guide) and hasattr(guide, "__code__") \
        else type(guide).__name__
    return f"the guide {name}"


def zero_weights_message(engine: str, n: int, proposal: str = "the proposal", *, where: str = "",
                         sites: tuple | list = (), group: str = "") -> str:
    """The one message of every :class:`ZeroWeightsError` on both backends (docs/architecture.md, "Rules that keep it
    right").

    The rule it explains: data of probability 0 exactly (x outside the image of Proj, Def 2.6: its lifting is
    empty) is not an error, the engines return log Z-hat = -inf with a warning; a run whose n weights
    w_i = p / q of (3.2) are *all* zero otherwise has nothing to return (no particle to weigh, resample or
    decode), and raises with this message. ``proposal`` names what drew the particles
    (:func:`describe_proposal`), ``where`` the step (``"after step 3 of Foo"``), ``sites`` the sites whose
    log-probability is -inf in every particle, ``group`` the group of a grouped run (``"of group 2 "``)."""
    at = f" {where}" if where else ""
    sites = list(sites) if isinstance(sites, (list, tuple)) else [sites] if sites is not None else []
    named = f"; site(s) {', '.join(str(s) for s in sites)} score -inf in every particle" if sites else ""
    proposal = str(proposal)
    if proposal.startswith("the model's own prior"):
        fix = (f"{proposal} proposed every particle, and under each latent value it drew the data have "
               "probability 0. If the data are impossible under the model, log p(x) = -inf is the answer; "
               "otherwise the posterior is too far from the prior for n particles: pass a guide supported on it, "
               "or use more particles")
    else:
        fix = (f"{proposal} proposed only values the model (or a twist) gives probability 0 (a support mismatch): "
               "make it propose values of positive probability under the model (the lifting of x), or use more "
               "particles")
    return (f"{engine}: all {n} particle weights {group}are zero (every log weight is -inf){at}{named}: {fix}")
