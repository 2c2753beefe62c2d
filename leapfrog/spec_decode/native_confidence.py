"""The auto tree size's confidence model (confidence.py ``ConfidenceCurves``) in C++: the same state,
the same arithmetic in the same order, one call a step.

Every step of "auto" tree sizes moves the confidence curve and the seven gammas' calibrations
(``observe`` then ``calibrate``): in Python about 60 us of a 3.7 ms batch-1 step of the built-in
pair in the engine (25 us alone: the interpreter's loops over a few dozen floats, their objects
cold in the cache after the forward), 1.6 % of "auto"'s time, which the chain of the depth does not
pay. Here the state is a C++ object behind pybind11 (``Curves``), with ConfidenceCurves' interface;
``confidence_curves`` hands out this one where it builds and the Python one otherwise (no compiler,
``LEAPFROG_NATIVE_CONFIDENCE=0``). Doubles both, summed in the Python code's order, ``pow`` and
``log`` from the same libm, no contraction into FMAs: the two give the same floats (the test
replays random steps through both), so "auto" chooses the same sizes with either.
"""

from __future__ import annotations

from typing import Any

from leapfrog.utils.cpp import OpLibrary
from leapfrog.utils import env_off

_SOURCE = r"""
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int G = 7;
constexpr double GAMMAS[G] = {0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5};
constexpr int LINEAR = 4;
constexpr double EMA = 0.2;
constexpr double KEEP = 1 - EMA;

// rate.py TokenRate: accepted per predicted token, over sums that forget (window, steps, min_steps)
struct Rate {
  double accepted = 0.0, per = 0.0;
};

struct Memory {
  double window, steps, min_steps;
};
constexpr Memory RATES{64, 16, 4};      // rate.py's defaults
constexpr Memory SHAPE{512, 128, 4};    // confidence.py _SHAPE_WINDOW, _SHAPE_STEPS

double value(const Rate& r) { return r.per > 0 ? r.accepted / r.per : 1.0; }   // (prior 1.0)

// rate.py update_rates: each rate with the same accepted tokens and its own per
void update_rates(Rate* rates, const Memory& mem, double accepted, const std::vector<double>& per) {
  const double base = 1 - 1 / mem.window, least = 1 - 1 / mem.min_steps, most = 1 - 1 / mem.steps;
  const size_t n = per.size() < G ? per.size() : G;
  for (size_t g = 0; g < n; ++g) {
    const double p = per[g];
    if (p > 0) {
      double keep = std::pow(base, p);
      if (keep < least) keep = least;
      if (keep > most) keep = most;
      rates[g].accepted = keep * rates[g].accepted + accepted;
      rates[g].per = keep * rates[g].per + p;
    }
  }
}

// Python's a[:n] bounds
size_t head_of(long n, size_t size) {
  if (n < 0) n += static_cast<long>(size);
  if (n < 0) n = 0;
  return static_cast<size_t>(n) < size ? static_cast<size_t>(n) : size;
}

// the first-seen order and counts of the nonzero values (a Counter's items)
std::vector<std::pair<long, long>> counted(const std::vector<long>& values) {
  std::vector<std::pair<long, long>> out;
  for (long v : values) {
    if (!v) continue;
    bool found = false;
    for (auto& vc : out) {
      if (vc.first == v) { ++vc.second; found = true; break; }
    }
    if (!found) out.emplace_back(v, 1);
  }
  return out;
}

class Curves {
 public:
  Curves(long K, std::optional<long> depth) : K(K), depth(depth ? *depth : K) {}

  long K, depth;

  std::optional<std::vector<double>> curve() const {
    if (!has_curve_) return std::nullopt;
    return curve_;
  }
  long index() const { return index_; }
  void set_index(long i) {
    if (i < 0 || i >= G) throw py::index_error("gamma index out of range");
    index_ = i;
    model_.clear();
  }
  double gamma() const { return GAMMAS[index_]; }
  double calibration() const { return value(rates_[index_]); }
  double calibration_at(double gamma) const {
    for (int g = 0; g < G; ++g)
      if (GAMMAS[g] == gamma) return value(rates_[g]);
    throw py::value_error("gamma is not one of GAMMAS");
  }

  std::vector<double> model_curve(long n, std::optional<double> gamma) {
    if (!has_curve_) return {};
    const double g = gamma ? *gamma : GAMMAS[index_];
    const size_t len = head_of(n, curve_.size());
    if (g == 1.0) return std::vector<double>(curve_.begin(), curve_.begin() + len);
    if (!gamma && model_.size() >= len && static_cast<long>(model_.size()) >= n)
      return std::vector<double>(model_.begin(), model_.begin() + len);
    std::vector<double> out = powered(len, g);
    for (size_t i = 1; i < out.size(); ++i) out[i] = out[i - 1] + out[i];
    if (!gamma) model_ = out;
    return out;
  }

  std::optional<std::vector<double>> observe(const std::vector<std::vector<double>>& scores,
                                             const std::vector<long>& verified,
                                             std::optional<std::vector<long>> accepted) {
    const size_t Ku = static_cast<size_t>(K);
    std::vector<double> means;
    if (scores.size() == 1) {   // (batch 1: its sums are the means)
      const auto& sc = scores[0];
      const size_t n = sc.size() < Ku ? sc.size() : Ku;
      double c = 0.0;
      for (size_t i = 0; i < n; ++i) {
        c = i ? c + sc[i] : sc[i];
        means.push_back(c);
      }
    } else {
      size_t L = 0;
      for (const auto& sc : scores) L = std::max(L, sc.size() < Ku ? sc.size() : Ku);
      std::vector<double> sums(L, 0.0);
      std::vector<long> counts(L, 0);
      for (const auto& sc : scores) {   // (sum(col): from 0, in order)
        const size_t n = sc.size() < Ku ? sc.size() : Ku;
        double c = 0.0;
        for (size_t i = 0; i < n; ++i) {
          c = i ? c + sc[i] : sc[i];
          sums[i] += c;
          ++counts[i];
        }
      }
      for (size_t i = 0; i < L; ++i) means.push_back(sums[i] / static_cast<double>(counts[i]));
    }
    const size_t L = means.size();
    if (L == 0) return std::nullopt;
    std::vector<double> head(L);
    for (size_t i = 0; i < L; ++i) head[i] = has_curve_ ? KEEP * curve_[i] + EMA * means[i] : means[i];
    for (size_t i = 1; i < L; ++i)   // (max(total, x): x only where greater)
      if (!(head[i] > head[i - 1])) head[i] = head[i - 1];
    const double last = head[L - 1];
    std::vector<double> next(head);
    if (!has_curve_) {
      next.resize(Ku > L ? Ku : L, last);
    } else {
      const double at = curve_[L - 1];
      for (size_t i = L; i < curve_.size(); ++i) next.push_back(curve_[i] + last - at);
    }
    curve_ = std::move(next);
    has_curve_ = true;
    model_.clear();
    const size_t P = std::min(verified.size(), scores.size());
    std::vector<long> n(P);
    long top = 0;
    for (size_t b = 0; b < P; ++b) {
      long v = verified[b];
      v = std::min(v, static_cast<long>(scores[b].size()));
      v = std::min(v, K);
      n[b] = v;
      if (b == 0 || v > top) top = v;
    }
    if (top <= 0) return std::nullopt;
    // C_gamma(0..top) per gamma
    const std::vector<double> m = increments(static_cast<size_t>(top));
    std::vector<std::vector<double>> prefix(G);
    for (int g = 0; g < G; ++g) {
      const std::vector<double> pw = power(m, GAMMAS[g]);
      auto& pre = prefix[g];
      pre.assign(1, 0.0);
      double c = 0.0;
      for (size_t i = 0; i < pw.size(); ++i) {
        c = i ? c + pw[i] : pw[i];
        pre.push_back(c);
      }
    }
    if (accepted) fit_shape(prefix, n, *accepted);
    std::vector<double> out(G);
    if (n.size() == 1) {
      for (int g = 0; g < G; ++g) out[g] = prefix[g][top];
      return out;
    }
    const auto sizes = counted(n);
    for (int g = 0; g < G; ++g) {
      double s = 0.0;
      for (const auto& vc : sizes) s += static_cast<double>(vc.second) * prefix[g][vc.first];
      out[g] = s;
    }
    return out;
  }

  std::optional<std::vector<double>> chain_prediction(long k, double chains) const {
    if (!has_curve_) return std::nullopt;
    const std::vector<double> m = increments(head_of(k, curve_.size()));
    std::vector<double> out(G);
    for (int g = 0; g < G; ++g) {
      const std::vector<double> pw = power(m, GAMMAS[g]);
      double s = 0.0;
      for (double x : pw) s += x;
      out[g] = s * chains;
    }
    return out;
  }

  void calibrate(double accepted, const std::vector<double>& predicted) {
    update_rates(rates_, RATES, accepted, predicted);
    pick();
  }

  void replace_calibration(double accepted, const std::vector<double>& predicted) {
    for (int g = 0; g < G; ++g) rates_[g] = Rate{accepted, g < static_cast<int>(predicted.size()) ? predicted[g] : 0.0};
    pick();
  }

 private:
  bool has_curve_ = false;
  std::vector<double> curve_;
  std::vector<double> model_;   // C_gamma(1..) of the model in use (cache)
  Rate rates_[G], shallow_[G], deep_[G];
  long index_ = LINEAR;

  // m_1..m_n, the mean confidences of candidates 1..n
  std::vector<double> increments(size_t n) const {
    n = std::min(n, curve_.size());
    std::vector<double> m(n);
    for (size_t i = 0; i < n; ++i) {
      const double d = curve_[i] - (i ? curve_[i - 1] : 0.0);
      m[i] = 0.0 > d ? 0.0 : d;
    }
    return m;
  }

  // m_i ** g for the best depth of the increments, m_i past them
  std::vector<double> power(const std::vector<double>& m, double g) const {
    std::vector<double> out(m);
    if (g != 1.0) {
      const size_t d = head_of(depth, m.size());
      for (size_t i = 0; i < d; ++i) out[i] = m[i] == 0.0 ? 0.0 : std::pow(m[i], g);
    }
    return out;
  }

  std::vector<double> powered(size_t n, double g) const { return power(increments(n), g); }

  void fit_shape(const std::vector<std::vector<double>>& prefix, const std::vector<long>& verified,
                 const std::vector<long>& accepted) {
    const long h = std::max(1L, depth / 2);
    std::vector<std::pair<long, long>> chains;
    const size_t P = std::min(verified.size(), accepted.size());
    for (size_t b = 0; b < P; ++b) {
      const long v = verified[b];
      if (0 < v && v <= depth) chains.emplace_back(v, std::min(accepted[b], v));
    }
    if (chains.empty()) return;
    long shallow_acc = 0, deep_acc = 0;
    for (const auto& vk : chains) {
      shallow_acc += std::min(vk.second, h);
      deep_acc += std::max(0L, vk.second - h);
    }
    std::vector<double> shallow_pred(G), deep_pred(G);
    if (chains.size() == 1) {
      const long v = chains[0].first, half = std::min(h, v);
      for (int g = 0; g < G; ++g) {
        shallow_pred[g] = prefix[g][half];
        deep_pred[g] = prefix[g][v] - shallow_pred[g];
      }
    } else {
      std::vector<long> vs;
      for (const auto& vk : chains) vs.push_back(vk.first);
      const auto sizes = counted(vs);
      for (int g = 0; g < G; ++g) {
        double s = 0.0, whole = 0.0;
        for (const auto& vc : sizes) {
          const long v = vc.first, half = std::min(h, v);
          const double c = static_cast<double>(vc.second);
          s += c * prefix[g][half];
          whole += c * prefix[g][v];
        }
        shallow_pred[g] = s;
        deep_pred[g] = whole - s;
      }
    }
    update_rates(shallow_, SHAPE, static_cast<double>(shallow_acc), shallow_pred);
    update_rates(deep_, SHAPE, static_cast<double>(deep_acc), deep_pred);
  }

  // the gamma under which the chains' deep half is calibrated like their shallow half
  void pick() {
    long index = LINEAR;
    double off = std::numeric_limits<double>::infinity();
    for (int g = 0; g < G; ++g) {
      const double sa = shallow_[g].accepted, sp = shallow_[g].per, da = deep_[g].accepted, dp = deep_[g].per;
      if (sp > 0 && dp > 0 && sa > 0 && da > 0) {
        const double d = std::fabs(std::log((da / dp) / (sa / sp)));
        if (d < off - 1e-12 || (d <= off + 1e-12 && std::fabs(std::log(GAMMAS[g])) < std::fabs(std::log(GAMMAS[index])))) {
          index = g;
          off = d;
        }
      }
    }
    if (index != index_) {
      index_ = index;
      model_.clear();
    }
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Curves>(m, "Curves")
      .def(py::init<long, std::optional<long>>(), py::arg("K"), py::arg("depth") = py::none())
      .def_readonly("K", &Curves::K)
      .def_readonly("depth", &Curves::depth)
      .def_property_readonly("curve", &Curves::curve)
      .def_property("index", &Curves::index, &Curves::set_index)
      .def_property_readonly("gamma", &Curves::gamma)
      .def_property_readonly("calibration", &Curves::calibration)
      .def("calibration_at", &Curves::calibration_at)
      .def("model_curve", &Curves::model_curve, py::arg("n"), py::arg("gamma") = py::none())
      .def("observe", &Curves::observe, py::arg("scores"), py::arg("verified"), py::arg("accepted") = py::none())
      .def("chain_prediction", &Curves::chain_prediction)
      .def("calibrate", &Curves::calibrate)
      .def("replace_calibration", &Curves::replace_calibration);
}
"""

_LIBRARY = OpLibrary("leapfrog_native_confidence", _SOURCE, ["-O2", "-ffp-contract=off"],
                     "native confidence model of auto tree sizes (about 10 s)", "the Python one serves", module=True)


def native_confidence_enabled() -> bool:
    """Whether the C++ model may serve (LEAPFROG_NATIVE_CONFIDENCE=0 turns it off)."""
    return not env_off("LEAPFROG_NATIVE_CONFIDENCE")


def load_native_confidence() -> bool:
    """Build (once, cached on disk) and load the module -> whether it is available."""
    return _LIBRARY.available()


def native_curves(K: int, depth: int | None = None) -> Any:
    """A C++ ``Curves`` (ConfidenceCurves' interface), or None where the module is off or unavailable."""
    if not native_confidence_enabled() or not load_native_confidence():
        return None
    return _LIBRARY.module.Curves(K, depth)
