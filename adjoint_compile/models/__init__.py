"""Small models that ship with the package: the demo trains :class:`.selective_ssm.SSMStack`, so ``adjoint-compile
demo`` works from an installed wheel as well as from a checkout."""
