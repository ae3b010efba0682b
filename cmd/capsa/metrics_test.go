package main

import (
	"context"
	"io"
	"log/slog"
	"math"
	"net/http/httptest"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
	"github.com/capsa-sandbox/capsa/supervisor/supervisortest"
)

// parseExposition parses text with Prometheus's own parser.
func parseExposition(t *testing.T, text string) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("Prometheus's parser: %v\n%s", err, text)
	}
	return fams
}

// TestExpositionMoreLabels: a family's samples may carry further labels
// (the flows' kind, verdict and rule), escaped, each series its own.
func TestExpositionMoreLabels(t *testing.T) {
	rule := `allow "a\b"`
	fams := []family{{name: "f_total", help: "Flows.", kind: "counter", label: "sandbox", samples: []sample{
		{label: "s", value: 3, more: `,kind="tcp",rule="` + labelEscaper.Replace(rule) + `"`},
		{label: "s", value: 1, more: `,kind="dns",rule="public-only"`},
	}}}
	var b strings.Builder
	if err := writeExposition(&b, fams); err != nil {
		t.Fatal(err)
	}
	f := parseExposition(t, b.String())["f_total"]
	if f == nil || len(f.Metric) != 2 {
		t.Fatalf("f_total = %v; want two series", f)
	}
	got := map[string]float64{}
	for _, m := range f.Metric {
		l := map[string]string{}
		for _, p := range m.GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		got[l["sandbox"]+"|"+l["kind"]+"|"+l["rule"]] = m.GetCounter().GetValue()
	}
	if got["s|tcp|"+rule] != 3 || got["s|dns|public-only"] != 1 {
		t.Errorf("series %v; want s|tcp|%s 3 and s|dns|public-only 1", got, rule)
	}
}

func TestWriteExposition(t *testing.T) {
	fams := []family{
		{name: "x_total", help: "A \\ help\nover two lines.", kind: "counter", label: "sandbox",
			samples: []sample{{label: `b "quoted" \ name` + "\n", value: 2}, {label: "a", value: 1.5e20}}},
		{name: "y", help: "Odd values.", kind: "gauge", label: "state",
			samples: []sample{{label: "inf", value: math.Inf(1)}, {label: "minf", value: math.Inf(-1)}, {label: "nan", value: math.NaN()}, {label: "small", value: 1e-7}}},
		{name: "empty", help: "No samples.", kind: "gauge", label: "sandbox"},
	}
	var b strings.Builder
	if err := writeExposition(&b, fams); err != nil {
		t.Fatal(err)
	}
	got := parseExposition(t, b.String())
	x := got["x_total"]
	if x == nil || x.GetType() != dto.MetricType_COUNTER || x.GetHelp() != "A \\ help\nover two lines." || len(x.Metric) != 2 {
		t.Fatalf("x_total = %v; want a counter with its help and two samples", x)
	}
	// In label order.
	for i, want := range []struct {
		label string
		value float64
	}{{"a", 1.5e20}, {`b "quoted" \ name` + "\n", 2}} {
		m := x.Metric[i]
		if l := m.GetLabel(); len(l) != 1 || l[0].GetName() != "sandbox" || l[0].GetValue() != want.label || m.GetCounter().GetValue() != want.value {
			t.Errorf("x_total sample %d = %v; want sandbox=%q %v", i, m, want.label, want.value)
		}
	}
	y := got["y"]
	if y == nil || y.GetType() != dto.MetricType_GAUGE || len(y.Metric) != 4 {
		t.Fatalf("y = %v; want a gauge with four samples", y)
	}
	vals := map[string]float64{}
	for _, m := range y.Metric {
		vals[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
	}
	if !math.IsInf(vals["inf"], 1) || !math.IsInf(vals["minf"], -1) || !math.IsNaN(vals["nan"]) || vals["small"] != 1e-7 {
		t.Errorf("y's values = %v; want +Inf, -Inf, NaN, 1e-7", vals)
	}
	if e, ok := got["empty"]; ok {
		t.Errorf("empty = %v; want no family without samples", e)
	}
	if strings.Contains(b.String(), "empty") {
		t.Errorf("the exposition describes a family without samples:\n%s", b.String())
	}
}

// The handler serves what capsa's store holds: here one sandbox being
// created, none running.
func TestMetricsHandler(t *testing.T) {
	dir := t.TempDir()
	supervisortest.Creating(t, dir, "one", sandbox.Spec{})
	m, err := supervisor.OpenManager(dir)
	if err != nil {
		t.Fatal(err)
	}
	h := newSandboxCollector(context.Background(), m).handler(slog.New(slog.NewTextHandler(io.Discard, nil)))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != 200 || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/plain; version=0.0.4") {
		t.Fatalf("GET /metrics = %d, %q; want 200, the text format", rec.Code, rec.Header().Get("Content-Type"))
	}
	fams := parseExposition(t, rec.Body.String())
	byState := map[string]float64{}
	for _, m := range fams["capsa_sandboxes"].GetMetric() {
		byState[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
	}
	want := map[string]float64{"created": 0, "creating": 1, "running": 0, "paused": 0, "exited": 0, "crashed": 0}
	for s, n := range want {
		if v, ok := byState[s]; !ok || v != n {
			t.Errorf("capsa_sandboxes{state=%q} = %v (present %v), want %v", s, v, ok, n)
		}
	}
	if len(fams) != 1 {
		t.Errorf("%d families, want 1 (capsa_sandboxes: the others have no sample with none running)", len(fams))
	}
}
