// MathJax settings for pymdownx.arithmatex (generic mode): it wraps maths in \( \) and \[ \] inside .arithmatex
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};
