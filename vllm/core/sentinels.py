"""Token ids that mark a draft slot rather than a token: shared by the scheduler (no torch), the input batch and the
rejection sampler."""

PLACEHOLDER_TOKEN_ID = -1  # a draft that is always rejected (padded prompt tails, drafts trimmed to the budget)
# A draft the DSpark drafter proposed on the device, scheduled before its id reached the host (never does): the
# input batch copies it from the drafter's output into the step's device tokens.
DEVICE_DRAFT_TOKEN_ID = -2
