"""One model of a hang and its views: text, JSON, Markdown, Mermaid, Graphviz, and its hand-off to pytest's reports."""
