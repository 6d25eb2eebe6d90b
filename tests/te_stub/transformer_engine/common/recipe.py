"""Recipe classes megatron names in isinstance checks."""


class Recipe:
    pass


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class Format:
    E4M3 = "E4M3"
    HYBRID = "HYBRID"
