"""erfc(a) for a >= 0 by W. J. Cody's rational Chebyshev approximations
("Rational Chebyshev approximations for the error function", Math. Comp. 23
(1969) 631-638; the coefficients of Netlib SPECFUN's CALERF): three
intervals of a, each a ratio of two polynomials, good to float64 rounding.
`erfc_abs(xp, a)` evaluates it elementwise with xp arithmetic (NumPy or
CuPy: nn/gelu.py's path); nn/passes.py's GELU kernel evaluates the same
coefficients one element at a time (only its own interval, and exp(-a^2)
once, which is also the normal density GELU's gradient needs).

    python -c "import numpy as np; from hpctrain.nn.erfc import erfc_abs; print(erfc_abs(np, np.array([0.5, 3.0])))"
"""

# CALERF's coefficients, highest index the leading one as Cody lists them
A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02, 3.20937758913846947e03,
      1.85777706184603153e-1)
B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03, 2.84423683343917062e03)
C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01, 2.98635138197400131e02,
      8.81952221241769090e02, 1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03,
      2.15311535474403846e-8)
D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02, 1.62138957456669019e03,
      3.29079923573345963e03, 4.36261909014324716e03, 3.43936767414372164e03, 1.23033935480374942e03)
P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1, 1.60837851487422766e-2,
      6.58749161529837803e-4, 1.63153871373020978e-2)
Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1, 6.05183413124413191e-2,
      2.33520497626869185e-3)
SQRPI = 5.6418958354775628695e-1   # 1 / sqrt(pi)
SMALL, MIDDLE = 0.46875, 4.0       # the intervals' bounds


def _ratio(num, den, lead_num, last_num, last_den, t):
    """Cody's evaluation: ((lead_num t + num[0]) t + ... ) / ((t + den[0]) t + ...)."""
    xnum, xden = lead_num * t, t
    for a, b in zip(num, den):
        xnum = (xnum + a) * t
        xden = (xden + b) * t
    return (xnum + last_num) / (xden + last_den)


def _gauss(xp, a):
    """exp(-a^2) as exp(-s^2) exp(-(a - s)(a + s)), s = a to 1/16: a^2
    rounded whole would lose a^2 ulps of it (CALERF's way)."""
    s = xp.trunc(a * 16.0) / 16.0
    return xp.exp(-s * s) * xp.exp(-(a - s) * (a + s))


def erfc_abs(xp, a):
    """erfc(a) for a >= 0 (an xp array): each interval's formula evaluated
    everywhere (no masks: no gathers, nothing for a GPU to wait on) and
    each element's own taken. Past a ~ 26.5 the result underflows to 0."""
    small = 1.0 - a * _ratio(A[:3], B[:3], A[4], A[3], B[3], a * a)
    middle = _ratio(C[:7], D[:7], C[8], C[7], D[7], a)
    safe = xp.maximum(a, MIDDLE)   # the third interval's 1/a^2, finite everywhere
    inv = 1.0 / (safe * safe)
    tail = (SQRPI - inv * _ratio(P[:4], Q[:4], P[5], P[4], Q[4], inv)) / safe
    return xp.where(a <= SMALL, small, xp.where(a < MIDDLE, middle, tail) * _gauss(xp, a))
