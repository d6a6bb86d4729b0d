"""The training layer's part of every draft method, attached to :mod:`draftsmith.methods`: the
training method class (``train/method_<name>.py``) and the dry run's parameter estimator.

:func:`draftsmith.methods.DraftMethodSpec.training_method` (and ``parameter_estimator``) load
this module on first use; the model and format parts are the method packages' own
(``models/<name>/__init__.py``).
"""

from __future__ import annotations

from ..methods import attach
from .dry_run import (
    dflash2_parameter_estimate,
    dflash_parameter_estimate,
    dspark_parameter_estimate,
    eagle3_parameter_estimate,
    medusa_parameter_estimate,
    mlp_speculator_parameter_estimate,
    peagle_parameter_estimate,
)
from .method_dflash import DFlashMethod
from .method_dspark import DSparkMethod
from .method_dflash2 import DFlash2Method
from .method_eagle3 import Eagle3Method
from .method_medusa import MedusaMethod
from .method_mlp_speculator import MLPSpeculatorMethod
from .method_peagle import PEagleMethod

attach("eagle3", training_method=Eagle3Method, parameter_estimator=eagle3_parameter_estimate)
attach("medusa", training_method=MedusaMethod, parameter_estimator=medusa_parameter_estimate)
attach("mlp_speculator", training_method=MLPSpeculatorMethod, parameter_estimator=mlp_speculator_parameter_estimate)
attach("dflash", training_method=DFlashMethod, parameter_estimator=dflash_parameter_estimate)
attach("peagle", training_method=PEagleMethod, parameter_estimator=peagle_parameter_estimate)
attach("dspark", training_method=DSparkMethod, parameter_estimator=dspark_parameter_estimate)
attach("dflash2", training_method=DFlash2Method, parameter_estimator=dflash2_parameter_estimate)
