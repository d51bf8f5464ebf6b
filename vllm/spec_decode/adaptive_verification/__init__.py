"""Adaptive verification (shared docs: dspark_and_adaptive.md): how many draft tokens a step verifies, and whose.

The host picks the step's draft budget b* from the draft confidences and profiled step costs, and spreads it
evenly over the verifying requests (its metadata then has the right total); the device re-cuts the same total
by survival, a global top-b* over the fresh confidences, and rewrites the row offsets the kernels and the
rejection sampler read. The two splits differ row by row ([3, 3] on the host, [4, 2] on the device) and agree
in total.

One concept a file: costs (profiled cost curves), budget (b* and the two splits), calibration (survivals
against what was accepted), step_times (what the engine measured), confidences (the drafter's, on both sides),
verifier (the device-trim hook), profile (which dummy steps to time at start-up, and how their timings fold into
the cost curves; the runner runs them). Tunables are module constants of the file that reads them.
"""
from vllm.spec_decode.adaptive_verification.budget import choose_budget, device_split, even_split, recut_lengths
from vllm.spec_decode.adaptive_verification.calibration import SurvivalCalibration, SurvivalPrediction
from vllm.spec_decode.adaptive_verification.confidences import DraftConfidences
from vllm.spec_decode.adaptive_verification.costs import MIN_VERIFY_COST, CostCurve, VerifyCosts
from vllm.spec_decode.adaptive_verification.profile import CostProfile, ProfileBatch, ProfileTimings, RecutDummy
from vllm.spec_decode.adaptive_verification.step_times import MeasuredShape, StepTimes
from vllm.spec_decode.adaptive_verification.verifier import AdaptiveVerifier

__all__ = ["MIN_VERIFY_COST", "AdaptiveVerifier", "CostCurve", "CostProfile", "DraftConfidences", "MeasuredShape",
           "ProfileBatch", "ProfileTimings", "RecutDummy", "StepTimes", "SurvivalCalibration", "SurvivalPrediction",
           "VerifyCosts", "choose_budget", "device_split", "even_split", "recut_lengths"]
