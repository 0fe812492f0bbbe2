"""``ptn.transforms``: the model transforms of ``pt.transforms`` as NumPyro handlers (torch: ppl_thought/transforms).

Each transform is a :class:`numpyro.primitives.Messenger` acting on the *sequence sites* of a program, the
``numpyro.sample(name, ptn.dist.LMSequence(lm, ...), obs=...)`` sites (the whole view), with the torch
constructor arguments and numbers:

- :class:`ProjectionLift` (Def 2.8, (2.22)): a plain LM program becomes Proj # P_f (ptn.handlers, re-exported);
- :class:`Forgetful` (Def 5.1, (5.5)-(5.8)): earlier thoughts leave the context when a new thought starts
  (the site's LM is read through :class:`ForgetfulLM`);
- :class:`Persistent` / :class:`Ubiquitous` (5.6.1): thoughts stay in context / may stand anywhere in the text;
- :class:`CostAware` ((5.26)-(5.27), 5.6.3): records the latent lengths |Z| and holds the estimators of 5.6.3;
- :class:`ActiveLift` (Section 6, ppl_thought/numpyro/transforms/active.py): a learned sampler Q, latent prior P and
  generator G in one LM in place of a fixed projection (the model X ~ G(. | Z), Z ~ P of (6.13));
- :func:`compose`: ``compose(A, B, C)(model) == A(B(C(model)))``.

Apply one as on the torch side, ``Forgetful()(ProjectionLift(proj)(model))``, or as NumPyro handlers are applied,
``Forgetful(fn=model)`` / ``with Forgetful(): ...``. Calling a transform on a model returns a new handler bound to
that model (the transform itself stays unbound, so one transform may be applied to several models). A run of a
bound transform that met nothing it acts on raises :class:`~ppl_thought.errors.TransformError` naming what it
needs and the sequence sites the run had (the torch checks of issue 41).

The step view: a ``ptn.Program`` starts its ``ptn.dist.LMState`` with :func:`sequence_start` (an effect; the torch
``pt.transforms.sequence_start``), which :class:`Forgetful` and :class:`Persistent` act on; :class:`CostAware`
prices the segments and tokens the program samples from such a state. ``T(program)`` is a :class:`Transformed`
program that every engine runs; a program that starts no sequence (or, for CostAware, samples no latent segment)
is refused with a ``TransformError`` while the engine traces it.
"""

from ppl_thought.numpyro.handlers import ProjectionLift
from ppl_thought.numpyro.transforms.active import ActiveLift, GeneratorSequence
from ppl_thought.numpyro.transforms.base import Transform, Transformed, compose, sequence_start
from ppl_thought.numpyro.transforms.cost import CostAware, latent_lengths
from ppl_thought.numpyro.transforms.thinking import Forgetful, ForgetfulLM, Persistent, Ubiquitous, forgetful_keep

__all__ = ["ActiveLift", "CostAware", "Forgetful", "ForgetfulLM", "GeneratorSequence", "Persistent", "ProjectionLift",
           "Transform", "Transformed", "Ubiquitous", "compose", "forgetful_keep", "latent_lengths", "sequence_start"]
